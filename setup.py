"""Package discovery (everything else is in pyproject.toml).

methods/ and kernels/ live at the top of the repository but install as kvbench.methods / kvbench.kernels, so no
top-level package named `methods` lands in users' environments; every folder with an __init__.py is found, so
adding a task, a method or a package needs no list edited.
"""

from setuptools import find_packages, setup


def under(folder: str, name: str) -> list[str]:
    return [name] + [f"{name}.{sub}" for sub in find_packages(folder)]


setup(
    package_dir={
        "kvbench": "kvbench",
        "kvbench.methods": "methods",
        "kvbench.kernels": "kernels",
        "kvbench.conf": "conf",
    },
    packages=find_packages(include=["kvbench", "kvbench.*"])
    + under("methods", "kvbench.methods")
    + under("kernels", "kvbench.kernels")
    + ["kvbench.conf"],
)
