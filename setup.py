"""Package discovery (everything else is in pyproject.toml).

methods/ lives at the top of the repository but installs as kvbench.methods, so no top-level package named `methods`
lands in users' environments; every folder with an __init__.py is found, so adding a task, a method or a package
needs no list edited. No top-level folder shadows an installed package either: the kernels live in kvbench/kernels
(a folder named `kernels` at the root would hide Hugging Face's `kernels`, which transformers imports).
"""

from setuptools import find_packages, setup


def under(folder: str, name: str) -> list[str]:
    return [name] + [f"{name}.{sub}" for sub in find_packages(folder)]


setup(
    package_dir={"kvbench": "kvbench", "kvbench.methods": "methods", "kvbench.conf": "conf"},
    packages=find_packages(include=["kvbench", "kvbench.*"]) + under("methods", "kvbench.methods") + ["kvbench.conf"],
)
