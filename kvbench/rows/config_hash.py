"""The configuration hash that keys a configuration's rows in the store: model, dtype, device, task settings and
data digests, method, parameters, budget — and what changes rows' last bits (batched decoding, the C kernels)."""

from __future__ import annotations

from kvbench import KvbenchError
from kvbench.config.spec import RunSpec
from kvbench.kernels.backend import backend
from kvbench.native import slots
from kvbench.native.grid_decode import MAX_PADDING
from kvbench.rows import modes
from kvbench.rows.configuration import Configuration
from kvbench.store.results import config_hash
from kvbench.tasks import TASKS


def grid_batching(spec: RunSpec, lm, requested: int) -> bool:
    """Whether a grid's configurations of one example decode together (kvbench.native.grid_decode): grid_batch=auto does
    where the rows are identical to one by one (tested) and the run requests more than one configuration besides the
    full-cache baseline — a single method's run (the default job) decodes each configuration alone, so the first
    decode_ms_per_token a user reads is each method's own, not a batch's shared step; true always; false never."""
    if lm.layout.has_sliding and not decode_kernels(lm):
        return False  # window layers step together (grid_decode.GridWindowLayer) where the kernels are tested exact
    setting = spec.grid_batch
    if getattr(lm.layout, "is_hybrid", False):  # each row's linear/Mamba states are its own: rows decode one by one
        if setting is True:
            raise KvbenchError(
                "grid_batch=true cannot decode a hybrid model's configurations together (each keeps its own "
                "linear-attention/Mamba state); use grid_batch=auto"
            )
        return False
    return requested > 1 and grid_rows_as_alone(lm) if setting == "auto" else bool(setting)


def grid_batch_forced(spec: RunSpec, lm) -> bool:
    """grid_batch=true where a grid row does not decode as it does alone: rows of their own (auto never batches
    there, so whatever the number of configurations its rows are the one-by-one rows)."""
    setting = spec.grid_batch
    return setting != "auto" and bool(setting) and not grid_rows_as_alone(lm)


def grid_rows_as_alone(lm) -> bool:
    """Whether a grid row decodes as it does alone: with the row-independent linear kernel (CPU, float32 or
    bfloat16: the CPU backend's, kvbench.kernels.cpu) bit for bit; in float32 without it, token for token in every test
    (MKL's several-row products differ from its one-row product in the last bit); else not (bf16 products round
    a row by the batch size)."""
    return decode_kernels(lm) or str(lm.dtype).removeprefix("torch.") == "float32"


def grid_padding(spec: RunSpec) -> float:
    """A grid batch's memory bound (× its rows' own cache bytes): the run's, else the engine's default."""
    return MAX_PADDING if spec.grid_padding is None else spec.grid_padding


def forced_grid_keys(spec: RunSpec) -> dict:
    """Hash keys of rows grid-batched where rows depend on their batch: the setting, and a non-default padding."""
    padding = grid_padding(spec)
    return {"grid_batch": True, **({"grid_padding": padding} if padding != MAX_PADDING else {})}


def decode_kernels(lm) -> bool:
    """Whether decode steps run the CPU backend's C kernels (kvbench/kernels/cpu/decode_linear.py, single_query.py)."""
    return slots.decode_kernels(lm.model)


def bf16_kernels(lm) -> bool:
    """Whether a bf16 model's attention statistics run the CPU backend's AVX512-BF16 dot products (H2O's all-query
    column sums, kvbench/kernels/cpu/column_sums.py) instead of widened sgemm: they sum in their own order."""
    if lm.device.type != "cpu" or str(lm.dtype) != "torch.bfloat16":  # asked first: CUDA and fp32 runs build nothing
        return False
    cpu = backend("cpu")
    return cpu is not None and cpu.bf16_column_sums()


def hash_configuration(
    c: Configuration, spec: RunSpec, lm, data: list[tuple[str, str]] | None = None, engine_version: str | None = None
) -> str:
    """`data`: (file name, sha256) of each file the task reads (store.results.data_digests): an edited file is a new
    key, a moved one is not.
    `engine_version`: a serving engine's (kvbench.engines): another build's rows are other rows."""
    selection = TASKS.get(spec.task_name).selection_keys  # they pick examples, not change them: rows stay reusable
    task = {k: v for k, v in spec.task.items() if k not in selection}
    return config_hash(
        {
            "model": spec.model,
            "dtype": str(lm.dtype),
            "device": lm.device.type,
            "task": task,
            "seed": spec.seed,
            "method": c.method.name,
            "params": c.method.params(),
            "budget": c.budget_value,
            "query_aware": c.query_aware,
            **({"data": data} if data else {}),
            **modes.hash_keys(spec, TASKS.get(spec.task_name)),  # prefix cache, inline/chunked prefill, batch, engine
            **({"engine_version": engine_version} if engine_version else {}),
            # outside float32, decoding configurations together may change a last bit (and a token), and which rows
            # share a batch (grid_padding) with it: apart
            **(forced_grid_keys(spec) if grid_batch_forced(spec, lm) else {}),
            # the C decode kernels round differently from torch's products and sdpa: their rows are their own
            **({"decode_kernels": "c"} if decode_kernels(lm) else {}),
            **({"bf16_kernels": "column-sums"} if bf16_kernels(lm) else {}),
            # a captured step attends over its buffers under a mask (kvbench.native.graph_decode): its own last bits
            **({"decode_graph": True} if spec.decode_graph else {}),
        }
    )
