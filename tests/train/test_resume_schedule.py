"""Resume follows Megatron-LM for the lr/weight-decay schedule: a schedule flag that differs
from the checkpoint's is an error naming both values, unless --override-opt_param-scheduler
(this run's schedule) or --use-checkpoint-opt_param-scheduler (the checkpoint's) is given."""
import os
import re
import subprocess
import sys

import pytest
import torch

from llm_act.train import optim
from llm_act.train.args import parse_args
from tests.train.test_resume import TINY, run

#: --lr-decay-iters defaults to --train-iters; a nonzero floor, to tell schedules apart after decay
BASE = TINY + ["--min-lr", "1e-4"]
LR = re.compile(r" iteration +(\d+)/ +\d+ \| .*\| lr: (\S+) \|")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def logged_lrs(lines):
    return {int(m.group(1)): m.group(2) for m in map(LR.match, lines) if m}


def fresh_lr(argv, steps):
    """The lr a fresh scheduler of `argv`'s flags gives after `steps` iterations."""
    args = parse_args(BASE + argv)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = optim.scheduler(opt, args)
    sched.step(steps)
    return opt.param_groups[0]["lr"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A checkpoint of iteration 3 whose schedule ended there (decay iters = train iters = 3)."""
    path = str(tmp_path_factory.mktemp("sched") / "ckpt")
    run(["--train-iters", "3", "--save", path], base=BASE)
    return path


def test_a_larger_train_iters_is_refused_naming_both_values_and_the_flags(ckpt):
    with pytest.raises(ValueError) as err:
        run(["--train-iters", "6", "--load", ckpt], base=BASE)
    msg = str(err.value)
    assert "--lr-decay-iters (default: --train-iters) 3 in the checkpoint, 6 now" in msg
    assert "--override-opt_param-scheduler" in msg and "--use-checkpoint-opt_param-scheduler" in msg
    with pytest.raises(ValueError, match=r"--lr 0\.003 in the checkpoint, 0\.002 now; --lr-decay-style "
                                         r"'cosine' in the checkpoint, 'linear' now"):
        run(["--train-iters", "3", "--lr", "2e-3", "--lr-decay-style", "linear", "--load", ckpt], base=BASE)


def test_override_follows_the_new_schedule(ckpt):
    lines = []
    out = run(["--train-iters", "6", "--load", ckpt, "--override-opt_param-scheduler"], lines, base=BASE)
    lrs = logged_lrs(lines)
    assert sorted(lrs) == [4, 5, 6]
    for it, text in lrs.items():  # iteration `it` trains at the lr after it - 1 scheduler steps
        want = fresh_lr(["--train-iters", "6"], it - 1)
        assert want > 2e-4 and text == f"{want:.4E}"
    sched = out["trainer"].scheduler
    assert sched.lr_decay_steps == 6 and sched.num_steps == 6
    assert any(line.startswith(" > --override-opt_param-scheduler: using this run's schedule") and
               "3 in the checkpoint, 6 now" in line for line in lines)


def test_use_checkpoint_keeps_the_checkpoints_schedule(ckpt):
    lines = []
    out = run(["--train-iters", "5", "--lr", "1e-2", "--load", ckpt, "--use-checkpoint-opt_param-scheduler"],
              lines, base=BASE)
    # the checkpoint's schedule ended at iteration 3: min-lr from then on, not the new --lr
    assert logged_lrs(lines) == {4: "1.0000E-04", 5: "1.0000E-04"}
    assert out["trainer"].scheduler.max_lr == 3e-3 and out["trainer"].scheduler.lr_decay_steps == 3
    assert any(line.startswith(" > --use-checkpoint-opt_param-scheduler: using the checkpoint's schedule")
               for line in lines)


def test_a_longer_run_with_the_same_schedule_resumes_without_a_flag(tmp_path):
    """--train-iters alone is no schedule argument when --lr-decay-iters is given."""
    ckpt = str(tmp_path / "ckpt")
    run(["--train-iters", "2", "--lr-decay-iters", "8", "--save", ckpt], base=BASE)
    out = run(["--train-iters", "3", "--lr-decay-iters", "8", "--load", ckpt], base=BASE)
    assert out["iterations"] == 3


def test_both_flags_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"])
    assert exc.value.code == 2
    assert "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler: give at most one" \
        in capsys.readouterr().err


def test_pretrain_gpt_exits_2_with_one_line_and_no_traceback(ckpt):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "pretrain_gpt.py"), *BASE,
                           "--train-iters", "6", "--load", ckpt], capture_output=True, text=True,
                          timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == [f"pretrain_gpt.py: error: --load {ckpt}: the lr/weight-decay schedule differs from "
                      "the checkpoint's: --lr-decay-iters (default: --train-iters) 3 in the checkpoint, "
                      "6 now; pass --override-opt_param-scheduler to use the new values or "
                      "--use-checkpoint-opt_param-scheduler to keep the checkpoint's"]
    assert " iteration " not in proc.stdout  # refused before training


def _resume_on_two_ranks(rank, world, port, ckpt, port2):
    """Rank `rank` of a DP=2 job: save through the loop's `main`, then resume with a longer
    schedule; every rank must return 2 with the message (none may wait in a collective)."""
    import contextlib
    import io

    from llm_act.train import loop

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with contextlib.redirect_stdout(io.StringIO()):
        assert loop.main(BASE + ["--train-iters", "2", "--save", ckpt]) == 0
    os.environ["MASTER_PORT"] = str(port2)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        assert loop.main(BASE + ["--train-iters", "4", "--load", ckpt]) == 2
    assert "--lr-decay-iters (default: --train-iters) 2 in the checkpoint, 4 now" in err.getvalue(), err.getvalue()


@pytest.mark.dist
def test_every_rank_refuses_the_schedule_without_hanging(tmp_path):
    from tests import testing as T

    T.spawn(_resume_on_two_ranks, 2, str(tmp_path / "ckpt"), T.free_port(), timeout=150)
    assert os.path.exists(tmp_path / "ckpt" / "iter_0000002" / "mp_rank_00_000_001" / "model_optim_rng.pt")
