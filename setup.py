"""What pyproject.toml cannot say: the repository's `suites/` folder ships inside the package as
`detaudit/builtin_suites/` (found by `detaudit.paths.builtin_suites_dir`), while every other package is
still found automatically. The files each package ships are pyproject.toml's `package-data`."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["detaudit*"]) + ["detaudit.data", "detaudit.builtin_suites"],  # data: no .py
    package_dir={"detaudit.builtin_suites": "suites"},
)
