"""Packaging is declared in pyproject.toml; this adds one file to the build: a ``.pth`` that
makes the pre-0.2 top-level tier names (``import consumers.batch_consumer``) warn and work in
an environment where rollstream is installed, for one release (see rollstream/_names.py)."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "rollstream-old-names.pth"
PTH_LINE = "import rollstream\n"  # rollstream/__init__ installs the import hooks


class BuildWithOldNames(build_py):
    def run(self) -> None:
        super().run()
        (Path(self.build_lib) / PTH).write_text(PTH_LINE)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


class _AlsoOldNames:
    """An editable install's strategy, writing the ``.pth`` beside its own."""

    def __init__(self, strategy) -> None:
        self._strategy = strategy

    def __enter__(self):
        self._strategy.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._strategy.__exit__(*exc)

    def __call__(self, wheel, *args, **kwargs) -> None:
        self._strategy(wheel, *args, **kwargs)
        wheel.writestr(PTH, PTH_LINE)


class EditableWithOldNames(editable_wheel):
    # setuptools' hook for the files of an editable wheel is private; where it is missing the
    # editable install goes without the .pth (the old names then work once rollstream is imported)
    def _select_strategy(self, *args, **kwargs):
        return _AlsoOldNames(super()._select_strategy(*args, **kwargs))


setup(cmdclass={"build_py": BuildWithOldNames, "editable_wheel": EditableWithOldNames})
