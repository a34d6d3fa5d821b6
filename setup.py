"""Package discovery for setuptools (everything else is in pyproject.toml).

The repository root is the ``kiln`` package: the card's top-level folders (exporter/, plugins/,
calibration/, ...) install as ``kiln.exporter``, ``kiln.plugins``, ... and never as bare top-level
packages. pyproject.toml cannot say "every package under the root, prefixed with kiln.", so this
file does: every folder with an ``__init__.py`` is found, none listed by hand (a hand list missed
three subpackages and broke every non-editable install). tests/, benchmarks/ and docs/ stay out,
and so does this file, although it sits in the package's folder.
"""

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

OUTSIDE_THE_PACKAGE = ("tests", "tests.*", "benchmarks", "benchmarks.*", "docs", "docs.*", "build", "build.*")


class BuildPy(build_py):
    """The wheel's modules, less this file (it is not part of kiln)."""

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        modules = super().find_package_modules(package, package_dir)
        return [module for module in modules if module[:2] != ("kiln", "setup")]


setup(
    package_dir={"kiln": "."},
    packages=["kiln", *(f"kiln.{name}" for name in find_packages(".", exclude=OUTSIDE_THE_PACKAGE))],
    cmdclass={"build_py": BuildPy},
)
