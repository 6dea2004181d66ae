"""``offload.planning`` and ``offload.monitoring`` use only the core's public names, so each
carries a copy of the few eager checkers it needs; the copies stay identical to the core's."""

import inspect

import pytest

from offload import _checks as core
from offload.monitoring import _checks as monitoring
from offload.planning import _checks as planning


@pytest.mark.parametrize("copy", [planning, monitoring], ids=["planning", "monitoring"])
def test_each_copied_checker_is_the_cores(copy):
    assert copy.__all__
    for name in copy.__all__:
        assert inspect.getsource(getattr(copy, name)) == inspect.getsource(getattr(core, name)), (
            name
        )


@pytest.mark.parametrize("copy", [planning, monitoring], ids=["planning", "monitoring"])
def test_the_copies_raise_the_cores_messages(copy):
    for args, kwargs in (
        (("f", "x", True), {"low": 1}),
        (("f", "x", 0), {"low": 1}),
        (("f", "x", 3.0), {}),
    ):
        with pytest.raises(ValueError, match=r"^f: x: expected an int") as copied:
            copy.check_int(*args, **kwargs)
        with pytest.raises(ValueError) as original:
            core.check_int(*args, **kwargs)
        assert str(copied.value) == str(original.value)
    with pytest.raises(ValueError, match=r"^f: x: expected a finite float, got nan$"):
        copy.check_float("f", "x", float("nan"))
