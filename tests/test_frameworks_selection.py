"""`tests.frameworks`: the selection `.ci/run` runs again in its Python 3.12 venv (every test
that imports megatron-core, DeepSpeed or transformers) is read from the test files' source."""
from pathlib import Path

from tests import frameworks

TESTS = Path(frameworks.__file__).resolve().parent


def _selected(name: str) -> bool:
    return frameworks.reaches_framework((TESTS / name).resolve())


def test_direct_imports_fixtures_helpers_and_children_are_selected():
    assert _selected("patches/megatron/test_apply.py")  # imports the integration
    assert _selected("patches/deepspeed/test_launcher.py")  # the DeepSpeed door
    assert _selected("cpu/test_shim_moe.py")  # importorskip("megatron.core")
    assert _selected("test_block_schema.py")  # runs `-m tests.schema_extra_site_run` in a child
    assert _selected("planner/test_budget_train_cli.py")  # runs launch/pretrain_gpt.py
    assert _selected("test_wheel.py")  # imports every module of the wheel, by name
    assert _selected("train/test_broken_training.py")  # through tests/patches helpers too


def test_torch_only_tests_are_left_to_the_311_run():
    for name in ("codecs/test_int_quant.py", "kernels/test_traffic.py", "planner/test_milp.py",
                 "test_config.py"):
        assert not _selected(name), name
