"""The model group's rules accept every model kvbench ships and every loader it registers."""

import pytest
from omegaconf import OmegaConf

from kvbench import KvbenchError, conf_dir
from kvbench.preflight.model_fields import MODEL_KEYS, check_model


@pytest.mark.parametrize("path", sorted((conf_dir() / "model").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_model_passes_its_checks(path):
    check_model(OmegaConf.to_container(OmegaConf.load(path), resolve=True))


def test_the_loader_rule_names_every_registered_loader():
    from kvbench.model.load import LOADERS

    assert set(MODEL_KEYS["loader"].choices) == set(LOADERS.names())


def test_a_wrong_size_or_loader_is_refused_in_one_line():
    qwen = OmegaConf.to_container(OmegaConf.load(conf_dir() / "model" / "qwen2.5-0.5b.yaml"))
    with pytest.raises(KvbenchError, match="model.size"):
        check_model({**qwen, "size": "big"})
    with pytest.raises(KvbenchError, match="model.loader"):
        check_model({**qwen, "loader": "wheel_gguf"})
