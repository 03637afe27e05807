"""megatron's loss checks run on the project's loss: a loss that turns NaN or Inf stops the run
through megatron's rerun state machine (--check-for-nan-in-loss-and-grad is on by default).
The spiky-loss check (--check-for-spiky-loss) goes through the same call and judges a loss only
after megatron has seen 100 of them (rerun_state_machine.is_unexpectedly_large, one per
micro-batch from the second iteration on); a spike is not fatal: megatron reruns the step, finds
it reproducible and trains on (its validate_result with fatal=False). A batch whose loss is NaN
wherever it runs goes through megatron's whole recovery, over three jobs, to the job that skips
it."""

import json
import math
import re
import subprocess
import sys
from typing import NamedTuple

import pytest
from megatron.core.rerun_state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION, EXIT_CODE_RESUME_TO_DISAMBIGUATE, RerunStateMachine)

from _launch import REPO, TINY_MODEL, launch, tensorboard_scalars


@pytest.mark.slow
@pytest.mark.parametrize("bad, name", [("nan", "NaN"), ("inf", "Inf")])
def test_a_nan_or_inf_loss_stops_the_run_with_megatrons_message(bad, name, tmp_path):
    run = launch(1, [*TINY_MODEL, "--train-iters", "4", "--save", str(tmp_path / "ckpt"),
                     "--save-interval", "100", "--tensorboard-dir", str(tmp_path / "tb")],
                 script=REPO / "tests" / "_bad_loss_entry.py", env={"BAD_LOSS": bad})
    assert run.returncode != 0, f"trained on with a {name} loss:\n{run.log[-3000:]}"
    assert f"Unexpected result {bad}" in run.log, run.log[-3000:]
    assert f"found {name} in local forward loss calculation" in run.log, run.log[-3000:]
    logged = tensorboard_scalars(tmp_path / "tb", "lm loss")
    assert 4 not in logged, f"iterations logged after the {name}: {sorted(logged)}"


# 4 micro-batches an iteration: iterations 2-26 give megatron its 100 samples, 28 is judged.
SPIKE_AT, SPIKE_ITERS = 28, 30


EXPERT_BIAS = ["--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid"]
# megatron-core 0.19's quantile balancing: routing by a per-expert bias, no aux loss
QUANTILE_BALANCING = ["--moe-router-load-balancing-type", "quantile_balancing",
                      "--moe-aux-loss-coeff", "0"]
SCALARS = ("lm loss", "load_balancing_loss", "expert_load/tokens_mean/layer_1")


class SpikedRun(NamedTuple):
    log: str
    scalars: dict[str, dict[int, float]]  # tensorboard's, by tag


@pytest.fixture(scope="module")
def spiked_run(tmp_path_factory):
    """TINY_MODEL with `router`'s flags for SPIKE_ITERS iterations, `spike` added to every token
    loss at SPIKE_AT ("0": no spike, no rerun), the spiky-loss check on where `checked`. Each
    run once a module: the spiky-loss test and the rerun test judge the same expert-bias run."""
    runs: dict[tuple, SpikedRun] = {}

    def run(spike: str, router: list[str], checked: bool = True,
            env: dict | None = None) -> SpikedRun:
        key = (spike, tuple(router), checked, tuple(sorted((env or {}).items())))
        if key not in runs:
            board = tmp_path_factory.mktemp("spiked")
            flags = [*TINY_MODEL, "--train-iters", str(SPIKE_ITERS), "--tensorboard-dir",
                     str(board), *(["--check-for-spiky-loss"] if checked else []), *router]
            done = launch(1, flags, script=REPO / "tests" / "_bad_loss_entry.py",
                          env={"BAD_LOSS": spike, "BAD_LOSS_AT": str(SPIKE_AT), **(env or {})})
            runs[key] = SpikedRun(done.check().log,
                                  {tag: tensorboard_scalars(board, tag) for tag in SCALARS})
        return runs[key]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("checked", [True, False], ids=["check-for-spiky-loss", "unchecked"])
def test_a_spiky_loss_is_flagged_and_rerun_and_training_goes_on(checked, spiked_run):
    # +100 on every token loss (about 6 each): a loss sum ~17x the largest of the 100 before
    run = spiked_run("100", EXPERT_BIAS, checked=checked)
    flagged = re.findall(r"Unexpected result .* at iteration #(\d+) .*\(message='Spiky loss'\)",
                         run.log)
    reproduced = "First rerun: unexpected result is reproducible within the tolerance" in run.log
    if checked:
        # the iteration judged, as megatron logs it (rerun-iteration-number)
        assert flagged and set(flagged) == {str(SPIKE_AT)}, run.log[-4000:]
        assert reproduced, run.log[-4000:]
    else:
        assert not flagged and not reproduced, run.log[-4000:]
    logged = run.scalars["lm loss"]
    assert sorted(logged) == list(range(1, SPIKE_ITERS + 1))  # trained on, every iteration
    assert logged[SPIKE_AT] > 100 > max(v for i, v in logged.items() if i != SPIKE_AT)


@pytest.mark.slow
@pytest.mark.parametrize("router", [EXPERT_BIAS, QUANTILE_BALANCING],
                         ids=["expert-bias", "quantile-balancing"])
def test_a_rerun_step_trains_and_logs_as_the_step_itself(router, spiked_run):
    """rerun-restores-moe-step-state (and expert-load-metrics counting a step once). The
    reference is the same run without the spike, where megatron reruns nothing: the spike adds a
    constant to every token loss, so the step's gradients are the true loss's. Patched, after
    megatron's in-place rerun of iteration 28 the run trains on exactly as the reference, and
    iteration 28 logs the reference's load-balancing loss and expert load. Unpatched, the first
    run's finalize has already moved the router's bias (expert bias; quantile balancing's
    qb_beta), so the rerun routes with another bias and the step moves it twice (iterations 29-30
    differ), and megatron's MoE tracker logs both runs' load-balancing loss."""
    reference, patched = (spiked_run(spike, router).scalars for spike in ("0", "100"))
    unpatched = spiked_run("100", router, env={
        "MEGATRON_PATCHES_DISABLE": "rerun-restores-moe-step-state"}).scalars
    after = range(SPIKE_AT + 1, SPIKE_ITERS + 1)
    assert all(patched["lm loss"][i] == reference["lm loss"][i] for i in after)
    assert all(unpatched["lm loss"][i] != reference["lm loss"][i] for i in after)
    load = "expert_load/tokens_mean/layer_1"  # 8 sequences x 64 tokens x top-2 over 8 experts
    assert patched[load][SPIKE_AT] == unpatched[load][SPIKE_AT] == reference[load][SPIKE_AT] == 128
    balance = "load_balancing_loss"
    if router is QUANTILE_BALANCING:
        assert not reference[balance]  # no aux loss to log
        return
    assert patched[balance][SPIKE_AT] == reference[balance][SPIKE_AT] > 0
    assert unpatched[balance][SPIKE_AT] == pytest.approx(2 * reference[balance][SPIKE_AT],
                                                         rel=1e-2)


@pytest.mark.slow
@pytest.mark.parametrize("patched", [True, False], ids=["patched", "unpatched"])
def test_a_result_that_reproduces_without_save_stops_in_one_line(patched, tmp_path):
    """rerun-without-save. A NaN at iteration 3 reproduces when megatron reruns the step in
    place, and megatron asks for a checkpoint to rerun it from on another GPU; the run has no
    --save. Patched: one line saying so, exit 17, no traceback. Unpatched (megatron-core
    0.19.2): megatron's save fails with a TypeError from os.path.join on None, exit 1."""
    run = launch(1, [*TINY_MODEL, "--train-iters", "4"],
                 script=REPO / "tests" / "_bad_loss_entry.py",
                 env={"BAD_LOSS": "nan", "BAD_LOSS_AT": "3",
                      **({} if patched else {"MEGATRON_PATCHES_DISABLE": "rerun-without-save"})})
    assert "First rerun: unexpected result is reproducible" in run.log, run.log[-3000:]
    if patched:
        assert run.returncode == EXIT_CODE_FAILED_ON_RESULT_VALIDATION, run.log[-3000:]
        assert "rerun-without-save: iteration 3's result reproduced" in run.log, run.log[-3000:]
        assert "Traceback" not in run.log, run.log[-3000:]
    else:
        assert run.returncode == 1, run.log[-3000:]
        assert "TypeError: expected str, bytes or os.PathLike object, not NoneType" in run.log


# megatron's recovery from a batch that fails wherever it runs, with the default --rerun-mode
# validate_results: job 1 finds the NaN, reruns the step in place, saves a checkpoint to rerun
# it from and exits 16; job 2, on another node, reruns it and exits 17 ("Correct result (but
# possible Application error)"); each failure is a line of --result-rejected-tracker-filename,
# and job 3 skips an iteration that one rank failed twice (megatron's iterations_to_skip:
# 1-indexed, the numbers megatron logs; an iteration several ranks of one job failed is not
# skipped) and trains on from the same checkpoint. Run at TP2, whose two ranks compute the same
# loss.
NAN_AT, NAN_ITERS = 3, 4
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


def _nan_job(tmp_path, name: str, save: str, env: dict | None = None, flags: tuple = ()):
    """A TP2 job whose loss is NaN at NAN_AT, resuming from tmp_path/ckpt, writing tmp_path/
    rejected.txt; `env` and `flags` added to the launch's."""
    return launch(2, [*TINY_MODEL, *TP2, "--train-iters", str(NAN_ITERS),
                      "--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / save),
                      "--save-interval", "100", "--tensorboard-dir", str(tmp_path / name),
                      "--result-rejected-tracker-filename", str(tmp_path / "rejected.txt"),
                      *flags],
                  script=REPO / "tests" / "_bad_loss_entry.py",
                  env={"BAD_LOSS": "nan", "BAD_LOSS_AT": str(NAN_AT), **(env or {})})


def _lines(lines: list[str]) -> list[tuple[int, str, int]]:
    """(rank, status, iteration named) of each tracker line, sorted."""
    return sorted((int(re.search(r" rank=(\d+) ", line).group(1)),
                   re.search(r" status=RerunValidationStatus\.(\w+) ", line).group(1),
                   int(re.search(r" iteration=(\d+) ", line).group(1))) for line in lines)


STATUSES = ("INITIAL_RUN", "FIRST_RERUN_REPRODUCIBLE", "SECOND_RERUN_REPRODUCIBLE")


@pytest.mark.slow
def test_a_batch_that_fails_twice_is_skipped_and_training_goes_on(tmp_path, node_shim):
    """rerun-iteration-number, skipped-iteration-ends-rerun and the forward step's one tracker
    line per TP group. Every line is TP rank 0's and names iteration 3; job 3 skips it and
    trains iteration 4 from the checkpoint. With skipped-iteration-ends-rerun left out
    (megatron-core 0.19.2), job 3 skips iteration 3 as asked, but megatron's skipped step leaves
    the checkpoint's rerun state machine rerunning, and the next step runs no forward or
    backward and exits 17: the job never trains on.

    Job 2 runs on another node (tests/native/other_node_shim.c: megatron reads the node's name
    from uname). On the same node megatron exits 16 again ("Got rescheduled on the same GPU"), so
    a run on one machine skips the batch by its number (README): a job between 1 and 2 with
    `--iterations-to-skip 3`, megatron's flag, trains iteration 4 from job 1's checkpoint."""
    first = _nan_job(tmp_path, "first", "ckpt")
    assert first.returncode == EXIT_CODE_RESUME_TO_DISAMBIGUATE, first.log[-3000:]
    assert "First rerun: unexpected result is reproducible" in first.log, first.log[-3000:]
    by_number = _nan_job(tmp_path, "by-number", "ckpt-by-number",
                         flags=("--iterations-to-skip", str(NAN_AT)))
    assert "Will skip these iterations from tracker file: []" in by_number.log
    assert by_number.returncode == 0, by_number.log[-3000:]
    assert sorted(tensorboard_scalars(tmp_path / "by-number", "lm loss")) == [NAN_ITERS]
    second = _nan_job(tmp_path, "second", "ckpt",
                      env={"LD_PRELOAD": str(node_shim), "NODE_SHIM_HOSTNAME": "othernode"})
    assert second.returncode == EXIT_CODE_FAILED_ON_RESULT_VALIDATION, second.log[-3000:]
    assert "Second rerun: unexpected result is reproducible on a different GPU" in second.log
    lines = (tmp_path / "rejected.txt").read_text().splitlines()
    assert _lines(lines) == [(0, status, NAN_AT) for status in sorted(STATUSES)], lines
    third = _nan_job(tmp_path, "third", "ckpt-third")
    assert f"Will skip these iterations from tracker file: [{NAN_AT}]" in third.log
    assert third.returncode == 0, third.log[-3000:]
    assert f"skipped-iteration-ends-rerun: iteration {NAN_AT}," in third.log, third.log[-3000:]
    assert sorted(tensorboard_scalars(tmp_path / "third", "lm loss")) == [NAN_ITERS]
    stuck = _nan_job(tmp_path, "stuck", "ckpt-stuck",
                     env={"MEGATRON_PATCHES_DISABLE": "skipped-iteration-ends-rerun"})
    assert f"Will skip these iterations from tracker file: [{NAN_AT}]" in stuck.log
    assert stuck.returncode == EXIT_CODE_FAILED_ON_RESULT_VALIDATION, stuck.log[-3000:]
    assert "A checkpoint at the last iteration already exists" in stuck.log, stuck.log[-3000:]
    assert not tensorboard_scalars(tmp_path / "stuck", "lm loss")


def _failures_without_reruns(tmp_path, env: dict) -> list[str]:
    """Two jobs with --rerun-mode disabled, where each NaN stops the job at once (no rerun, no
    checkpoint, no other node needed); the tracker file's lines."""
    for job in ("first", "second"):
        run = _nan_job(tmp_path, job, "ckpt", env, flags=("--rerun-mode", "disabled"))
        assert run.returncode != 0 and "Unexpected result nan" in run.log, run.log[-3000:]
    return (tmp_path / "rejected.txt").read_text().splitlines()


@pytest.mark.slow
def test_a_line_from_each_tp_rank_keeps_the_batch_from_being_skipped(tmp_path):
    """The forward step's one line per TP group left out ($TRACKER_LINE_PER_RANK, as megatron's
    own GPT step writes them): both TP ranks write each failure of iteration 3, and megatron's
    reading of the file (RerunStateMachine.get_skipped_iterations_from_tracker_file, what the
    next job runs at its start) calls it a fault of several ranks and skips nothing."""
    lines = _failures_without_reruns(tmp_path, {"TRACKER_LINE_PER_RANK": "1"})
    assert _lines(lines) == [(rank, "RERUN_DISABLED", NAN_AT) for rank in (0, 0, 1, 1)], lines
    assert RerunStateMachine.get_skipped_iterations_from_tracker_file(
        str(tmp_path / "rejected.txt")) == []


@pytest.mark.slow
def test_unpatched_the_tracker_names_the_next_iteration(tmp_path):
    """rerun-iteration-number left out (megatron-core 0.19.2): during the step it logs as
    iteration 3 megatron's rerun state machine counts 4 (train() starts it at the iterations
    done, and it counts each step on top), so both jobs' lines name iteration 4 and megatron's
    reading of the file skips iteration 4, a good batch, while the bad one fails again. (With
    reruns on, the checkpoint rerun is not counted again and names 3: nothing is ever named
    twice, nothing skipped.)"""
    lines = _failures_without_reruns(tmp_path,
                                     {"MEGATRON_PATCHES_DISABLE": "rerun-iteration-number"})
    assert _lines(lines) == [(0, "RERUN_DISABLED", NAN_AT + 1)] * 2, lines
    assert RerunStateMachine.get_skipped_iterations_from_tracker_file(
        str(tmp_path / "rejected.txt")) == [NAN_AT + 1]


# Layouts whose ranks all read the same batches (one DP replica): TP2; PP2 x VPP2, where each
# rank reads every micro-batch once for each of its two model chunks.
SKIP_LAYOUTS = {"tp2": TP2, "pp2-vpp2": ["--num-layers", "4", "--pipeline-model-parallel-size",
                                         "2", "--num-virtual-stages-per-pipeline-rank", "2"]}


@pytest.mark.slow
@pytest.mark.parametrize("patched", [True, False], ids=["patched", "unpatched"])
@pytest.mark.parametrize("layout", sorted(SKIP_LAYOUTS))
def test_every_rank_reads_the_same_batches_after_a_skipped_iteration(layout, patched, tmp_path):
    """skipped-iteration-reads-every-rank. A tracker file naming iteration 3 twice on rank 0 (two
    jobs' lines, in megatron's format) makes megatron skip it. Patched, both ranks read the same
    micro-batches at iteration 4, as at 1-2. Unpatched, at TP2 megatron's skipped step reads
    iteration 3's batches on TP rank 0 only (megatron's GPT step reads there alone; the
    launcher's on every rank), so from iteration 4 on TP rank 1 reads other batches than TP rank
    0: the batch it missed, then each one late. At PP2 x VPP2 (one iterator per model chunk)
    megatron's skipped step fails on both ranks."""
    tracker = tmp_path / "rejected.txt"
    tracker.write_text("".join(
        f"ts=0 node=n device=0 jobID={job} rank=0 iteration=3 "
        f"status=RerunValidationStatus.RERUN_DISABLED result=nan message='loss'\n"
        for job in (1, 2)))
    run = launch(2, [*TINY_MODEL, *SKIP_LAYOUTS[layout], "--train-iters", "4",
                     "--result-rejected-tracker-filename", str(tracker)],
                 script=REPO / "tests" / "_bad_loss_entry.py",
                 env={"BAD_LOSS": "0", "BATCH_PROBE": "1",
                      **({} if patched else
                         {"MEGATRON_PATCHES_DISABLE": "skipped-iteration-reads-every-rank"})})
    assert "Will skip these iterations from tracker file: [3]" in run.log, run.log[-3000:]
    if not patched and layout == "pp2-vpp2":
        assert run.exit_codes == [1, 1], run.log[-3000:]
        assert "TypeError: 'list' object is not an iterator" in run.log, run.log[-3000:]
        return
    run.check()
    read: dict[tuple[int, int], list[int]] = {}
    # (not anchored at a line's start: the other rank's line may be cut by ours, each of which
    # is one write)
    for iteration, rank, tokens in re.findall(
            r"batch read: iteration (\d+) rank (\d+) tokens (\d+)$", run.log, re.M):
        read.setdefault((int(iteration), int(rank)), []).append(int(tokens))
    reads = 4 if layout == "tp2" else 8  # micro-batches x model chunks
    assert sorted({iteration for iteration, _ in read}) == [1, 2, 4], read
    assert all(len(read[i, rank]) == reads for i in (1, 2, 4) for rank in (0, 1)), read

    def batches(iteration, rank):  # the chunks of a virtual pipeline read in schedule order
        return sorted(read[iteration, rank])

    assert batches(1, 0) == batches(1, 1) and batches(2, 0) == batches(2, 1), read
    if patched:
        assert batches(4, 0) == batches(4, 1), read
    else:
        assert batches(4, 0) != batches(4, 1), read


@pytest.mark.slow
@pytest.mark.parametrize("kept", [True, False], ids=["training-lines", "every-line"])
def test_a_failed_evaluation_names_no_training_iteration_to_skip(kept, tmp_path):
    """A NaN loss in evaluation (after iteration 2) stops the run: megatron evaluates with its
    reruns disabled, so the check raises. The forward step writes no tracker line for it. With
    every check's failures written, as megatron's GPT step has them ($TRACKER_LINE_PER_RANK),
    each such job adds a line under training iteration 2, and after two of them megatron's
    reading of the file skips iteration 2, a batch that trained well."""
    tracker = tmp_path / "rejected.txt"
    for job in (1, 2):
        run = launch(1, [*TINY_MODEL, "--train-iters", "2", "--eval-interval", "2",
                         "--eval-iters", "1", "--result-rejected-tracker-filename", str(tracker)],
                     script=REPO / "tests" / "_bad_loss_entry.py",
                     env={"BAD_LOSS": "nan", "BAD_LOSS_IN": "evaluation",
                          **({} if kept else {"TRACKER_LINE_PER_RANK": "1"})})
        assert run.returncode != 0, run.log[-3000:]
        assert "Unexpected result nan" in run.log, run.log[-3000:]
        assert "iteration        2/" in run.log  # trained, then failed at evaluation
        lines = tracker.read_text().splitlines()  # megatron creates the file at its start
        if kept:
            assert lines == []
            return  # nothing to read back
        assert len(lines) == job and " iteration=2 status=RerunValidationStatus.RERUN_DISABLED " \
            in lines[-1], lines
    assert RerunStateMachine.get_skipped_iterations_from_tracker_file(str(tracker)) == [2]


# A job that resumes onto a bad batch: job 1 trains iterations 1-2 and stops with a checkpoint
# of iteration 2; job 2 resumes from it and its first step's batch overflows the model (NaN
# loss and gradients: $BAD_LOSS_TIMES).
RESUMED_NAN_AT = 3


def _finite_weights(checkpoint: str) -> dict[str, bool]:
    """Whether each weight of a torch_dist checkpoint is finite, read by megatron-core's own
    dist_checkpointing.load_plain_tensors (one gloo rank in a process of its own)."""
    reader = (
        "import json, sys, tempfile, torch\n"
        "torch.distributed.init_process_group('gloo', rank=0, world_size=1,\n"
        "    init_method='file://' + tempfile.mktemp())\n"
        "from megatron.core.dist_checkpointing import load_plain_tensors\n"
        "tensors = load_plain_tensors(sys.argv[1])\n"
        "print(json.dumps({k: bool(torch.isfinite(v).all()) for k, v in tensors.items()\n"
        "                  if k.endswith('weight') and torch.is_tensor(v)}))\n")
    read = subprocess.run([sys.executable, "-c", reader, checkpoint], capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert read.returncode == 0, read.stderr[-3000:]
    return json.loads(read.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("patched", [True, False], ids=["patched", "unpatched"])
def test_a_nan_at_the_first_step_after_a_resume_is_caught_before_it_trains(patched, tmp_path):
    """resumed-run-checks-first-iteration. Patched: job 2 finds the NaN at its first step,
    reruns it in place and saves the weights it resumed with to rerun it from (iteration 2,
    finite), the tracker naming iteration 3. Unpatched (megatron-core 0.19.2 judges nothing at a
    process's first iteration): iteration 3 trains its NaN gradients into the weights, the next
    step's loss is NaN from them, and megatron saves those weights as iteration 3, the newest
    checkpoint, to rerun iteration 4, a good batch, from."""
    common = [*TINY_MODEL, "--train-iters", "4", "--load", str(tmp_path / "ckpt"),
              "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
              "--result-rejected-tracker-filename", str(tmp_path / "rejected.txt")]
    env = {"BAD_LOSS": "nan", "BAD_LOSS_TIMES": "1",
           "MEGATRON_PATCHES_DISABLE": "" if patched else "resumed-run-checks-first-iteration"}
    first = launch(1, [*common, "--exit-interval", "2"], script=REPO / "tests" /
                   "_bad_loss_entry.py", env={**env, "BAD_LOSS_AT": "99"})
    assert first.returncode == 0, first.log[-3000:]
    second = launch(1, common, script=REPO / "tests" / "_bad_loss_entry.py",
                    env={**env, "BAD_LOSS_AT": str(RESUMED_NAN_AT)})
    assert second.returncode == EXIT_CODE_RESUME_TO_DISAMBIGUATE, second.log[-3000:]
    named = {iteration for _, _, iteration in
             _lines((tmp_path / "rejected.txt").read_text().splitlines())}
    newest = int((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    finite = _finite_weights(str(tmp_path / "ckpt" / f"iter_{newest:07d}"))
    assert finite, "no weights read"
    if patched:
        assert (named, newest) == ({RESUMED_NAN_AT}, RESUMED_NAN_AT - 1)
        assert all(finite.values()), finite
    else:
        assert (named, newest) == ({RESUMED_NAN_AT + 1}, RESUMED_NAN_AT)
        assert not any(finite.values()), finite


FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
        "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"]


@pytest.mark.slow
def test_under_megatron_fsdp_a_batch_that_fails_twice_is_skipped(tmp_path, node_shim):
    """megatron's recovery with fsdp_dtensor checkpoints, which keep no rerun state ("RerunState
    Machine checkpoints ONLY SUPPORTED for checkpoint format torch_dist"): job 2, on another
    node, starts on the failed iteration as a fresh run would. With
    resumed-run-checks-first-iteration it checks that step, finds the NaN again and exits 16
    once more (megatron's second-node verdict, 17, needs the rerun state); both jobs' lines make
    job 3 skip the iteration and train on. Only data-parallel rank 0's batch is bad, so one rank
    writes the lines."""
    def job(name: str, env: dict | None = None):
        return launch(2, [*TINY_MODEL, *FSDP, "--train-iters", str(NAN_ITERS),
                          "--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "ckpt"),
                          "--save-interval", "100", "--tensorboard-dir", str(tmp_path / name),
                          "--result-rejected-tracker-filename", str(tmp_path / "rejected.txt")],
                      script=REPO / "tests" / "_bad_loss_entry.py",
                      env={"BAD_LOSS": "nan", "BAD_LOSS_AT": str(NAN_AT), "BAD_LOSS_TIMES": "1",
                           "BAD_LOSS_RANK": "0", **(env or {})})

    first = job("first")
    assert first.returncode == EXIT_CODE_RESUME_TO_DISAMBIGUATE, first.log[-3000:]
    second = job("second", {"LD_PRELOAD": str(node_shim), "NODE_SHIM_HOSTNAME": "othernode"})
    assert second.returncode == EXIT_CODE_RESUME_TO_DISAMBIGUATE, second.log[-3000:]
    lines = _lines((tmp_path / "rejected.txt").read_text().splitlines())
    assert lines == [(0, status, NAN_AT) for status in sorted(STATUSES[:2] * 2)], lines
    third = job("third")
    assert f"Will skip these iterations from tracker file: [{NAN_AT}]" in third.log
    assert third.returncode == 0, third.log[-3000:]
    losses = tensorboard_scalars(tmp_path / "third", "lm loss")
    assert sorted(losses) == [NAN_ITERS] and all(map(math.isfinite, losses.values())), losses
