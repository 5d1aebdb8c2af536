"""The `nas` flow end to end through the real stack, as a user runs it (`paperline run nas`):
the campaign's results equal an in-process run of the same seeded campaign, MLflow holds one parent
run per campaign with one child run per evaluation and the artifacts, S3 holds the checkpoint, and
a campaign killed mid-run resumes to the same result."""

import functools
import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.stack, pytest.mark.filterwarnings("ignore")]

LIVE = {"optimizer": "lamoo", "problem": "live-mnist", "budget": 4, "q": 2, "n_init": 2, "campaign": "test-live",
        "problem_options": {"epochs": 1, "n_train": 500}}
# LaMOO's qLogEHVI scores 512 of the region's unseen cells per batch here, not the demo's 4096:
# what these tests check (the flow equals the in-process campaign, MLflow, S3, resume) does not
# depend on it, and each of the three campaigns computes its two model batches in 6 s instead of
# 23 (one thread, measured 2026-12-02).
FAST = {"n_candidates": 512}
OPTIONS = ["--set", f"optimizer_options={json.dumps(FAST)}"]
MAIN = ["--set", "budget=20", "--set", "campaign=test-demo", *OPTIONS]


def cli(run_cli, env, *args, summary=None):
    """``paperline ARGS`` (it must succeed); a stuck one fails with its stacks."""
    return run_cli(env, *args, *(["--summary-json", str(summary)] if summary else []), check=True)


@pytest.fixture(scope="module")
def nas_run(stack, tmp_path_factory, run_cli, cli_env):
    _, info = stack
    summary = tmp_path_factory.mktemp("nas") / "summary.json"
    proc = cli(run_cli, cli_env, "run", "nas", "--preset", "demo", *MAIN, "--set", f"live={json.dumps(LIVE)}",
               summary=summary)
    return info, proc, json.loads(summary.read_text())


@functools.cache
def reference():
    """The demo campaign (budget 20) run in this process: what the flow's must equal."""
    from paperline.kernels.search.campaign import Campaign, run_campaign

    return run_campaign(Campaign("nasbench201-cifar10", "lamoo", budget=20, q=5, seed=0, n_init=10,
                                 optimizer_options=FAST,
                                 problem_options={"objectives": ["val_accuracy_pct", "model_size_mb"]}))


def test_flow_prints_the_front_and_equals_the_in_process_campaign(nas_run):
    _, proc, summary = nas_run
    out = " ".join(proc.stdout.split())
    assert "Pareto front" in out and "hypervolume" in out
    import re

    points = re.findall(r"\(reference point \[([^\]]*)\]\)", out)  # 6 significant digits, not float reprs
    assert points and all(len(v.strip()) <= 12 for p in points for v in p.split(",")), points
    main, live = summary["campaigns"]
    assert (main["name"], main["evaluations"], live["name"], live["evaluations"]) == ("test-demo", 20, "test-live", 4)
    ref = reference()
    assert main["hypervolume"] == pytest.approx(ref.score_trace()[-1], rel=1e-12)
    assert sorted(e["index"] for e in main["pareto_front"]) == sorted(e.index for e in ref.pareto_front())
    assert live["hypervolume"] > 0 and live["objectives"] == ["val_accuracy_pct", "params_count", "latency_ms"]


def test_mlflow_has_parent_and_child_runs_with_curves_and_artifacts(nas_run):
    import pyarrow.parquet as pq

    from paperline.infra.tracking import Tracker

    info, _, summary = nas_run
    tracker = Tracker(info.mlflow_tracking_uri)
    client = tracker.client
    for camp in summary["campaigns"]:
        parent = client.get_run(camp["mlflow_parent_run_id"])
        assert parent.info.status == "FINISHED"
        assert parent.data.tags["prefect.flow_run_id"] == summary["prefect_flow_run_id"]
        assert parent.data.tags["paperline.params_key"] == camp["versus_best_earlier"]["params_key"]
        assert parent.data.tags["paperline.budget"] == str(camp["evaluations"])
        children = tracker.child_run_tags("nas", camp["mlflow_parent_run_id"])
        assert sorted(int(t["paperline.evaluation_index"]) for t in children) == list(range(camp["evaluations"]))
        hv = client.get_metric_history(parent.info.run_id, "hypervolume")
        assert sorted(m.step for m in hv) == list(range(1, camp["evaluations"] + 1))
        assert max(m.value for m in hv) == pytest.approx(camp["hypervolume"])
        names = {a.path for a in client.list_artifacts(parent.info.run_id)}
        assert {"pareto_front.png", "hypervolume.png", "partition_tree.json", "partition_tree.png",
                "evaluations.parquet"} <= names
    main = summary["campaigns"][0]
    path = client.download_artifacts(main["mlflow_parent_run_id"], "evaluations.parquet")
    table = pq.read_table(path).to_pandas()
    assert len(table) == 20 and table["pareto"].sum() == len(main["pareto_front"])
    tree = json.loads(open(client.download_artifacts(main["mlflow_parent_run_id"], "partition_tree.json")).read())
    assert tree["n"] == 20 and len(tree["children"]) == 2  # LaMOO split the 20 samples


def test_checkpoint_in_s3_holds_the_whole_campaign(nas_run):
    from paperline.infra.storage import ObjectStore

    info, _, summary = nas_run
    state = json.loads(ObjectStore.from_stack(info).get_bytes(summary["campaigns"][0]["checkpoint"]))
    assert len(state["campaign"]["evaluations"]) == 20
    assert state["mlflow_parent_run_id"] == summary["campaigns"][0]["mlflow_parent_run_id"]


def test_a_checkpoint_of_another_campaign_is_refused_before_the_flow_run(nas_run, run_cli, cli_env, stack,
                                                                         monkeypatch, request):
    """The named campaign's checkpoint holds q=5: asking it to resume with q=3 fails with one line
    before a flow run is created (it used to start one and mark it failed)."""
    from paperline.flows.pipelines import build_parameters, get_pipeline
    from paperline.infra.errors import InputError
    from paperline.infra.storage import ObjectStore

    proc = run_cli(cli_env, "run", "nas", "--preset", "demo", *MAIN, "--set", "q=3")
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 1 and "error: campaign='test-demo': a checkpoint of this name holds a campaign with " \
        "other q (3 here, 5 in the checkpoint); pick another name, or set resume=false to start over under this one " \
        "(replacing that campaign's " \
        "checkpoint)" in err, err
    assert "flow run" not in (proc.stdout + proc.stderr).lower() and "Traceback" not in proc.stderr
    # the same check, in this process (what `paperline run` calls before the flow run), whose
    # campaign locks are taken in the stack's state directory (they were in the user's ~/.paperline)
    from paperline.infra.settings import get_settings

    info = nas_run[0]
    monkeypatch.setenv("PAPERLINE_STATE_DIR", str(stack[0].state_dir))
    get_settings.cache_clear()
    request.addfinalizer(get_settings.cache_clear)  # later tests read their own environment's

    def refusal(*sets: str) -> str:
        params = build_parameters(get_pipeline("nas"), "demo", list(sets))
        params.validate_inputs()
        with pytest.raises(InputError) as err:
            params.validate_on_stack(info, ObjectStore.from_stack(info))
        return str(err.value)

    assert "holds a campaign with other optimizer ('qehvi' here, " in refusal(
        "budget=20", "campaign=test-demo", "optimizer=qehvi")  # not "optimizer_options"
    # not the reference point the other problem's default brings along (a trial read it as set)
    other = refusal("budget=20", "campaign=test-demo", "problem=nasbench201-cifar100", OPTIONS[1])
    assert "other problem ('nasbench201-cifar100' here, 'nasbench201-cifar10' in the checkpoint)" in other, other
    assert "ref_point" not in other, other
    # a budget below what the campaign has done would end at once, reporting 20 evaluations for 12
    assert refusal("campaign=test-demo", "budget=12", OPTIONS[1]).startswith(
        "budget=12: campaign 'test-demo' has already done 20 evaluations (its checkpoint)")
    # a damaged checkpoint is named, with the way out (a bare JSONDecodeError or KeyError: a trial)
    from paperline.flows.nas import campaigns_prefix

    uri = f"{campaigns_prefix(info.data_bucket)}/test-damaged/checkpoint.json"
    store = ObjectStore.from_stack(info)
    # (a JSON null read as no checkpoint: the campaign started over, replacing it, a trial)
    for content, why in ((b'{"campaign": {"problem": "ack', "JSONDecodeError: "), (b'{"foo": 1}', "no 'campaign' in it"),
                         (b"null", "ValueError: its JSON is null, not an object"),
                         (b"[]", "ValueError: its JSON is list, not an object")):
        store.put_bytes_to(content, uri)
        assert refusal("campaign=test-damaged").startswith(
            f"checkpoint='{uri}': not a readable campaign checkpoint ({why}"), why
        assert "resume=false starts the campaign over under this name, replacing it" in refusal("campaign=test-damaged")
    params = build_parameters(get_pipeline("nas"), "demo", ["campaign=test-damaged", "resume=false"])
    params.validate_inputs()
    params.validate_on_stack(info, store)  # the way out it names is taken
    # the checkpoint a campaign writes as it starts (no evaluation yet: a run stopped before its
    # first batch ended left an empty MLflow run, and its re-run a second one) is resumed
    from paperline.flows.nas import resumable
    from paperline.tasks.nas import save_checkpoint

    cp = build_parameters(get_pipeline("nas"), "demo", ["campaign=test-fresh"]).campaigns()[0]
    fresh = cp.build()
    uri = f"{campaigns_prefix(info.data_bucket)}/test-fresh/checkpoint.json"
    save_checkpoint(store, uri, {"campaign": fresh.state_dict(), "mlflow_parent_run_id": "abc123"})
    state, saved = resumable(cp, cp.build(), store, uri)
    assert state["mlflow_parent_run_id"] == "abc123" and saved.n_done == 0 and saved.budget == cp.budget
    assert (stack[0].state_dir / "locks" / "nas-test-damaged.lock").exists()  # (not ~/.paperline's)


def test_a_killed_campaign_resumes_to_the_uninterrupted_result(stack, run_cli, cli_env, tmp_path, nas_run):
    """Killed after its initial design, the campaign resumes from its S3 checkpoint to the result of
    the uninterrupted one: the in-process reference and the demo campaign (nas_run: the same
    parameters under another name), which its MLflow run is compared with."""
    from paperline.infra.storage import ObjectStore

    _, info = stack
    store = ObjectStore.from_stack(info)
    args = ["run", "nas", "--preset", "demo", "--set", "budget=20", *OPTIONS, "--set", "campaign=test-kill",
            "--set", "live=null"]
    uri = f"s3://{info.data_bucket}/nas/campaigns/test-kill/checkpoint.json"
    log = tmp_path / "killed.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "paperline.flows.cli", *args], env=cli_env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    done = 0
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if store.exists(uri):
            done = len(json.loads(store.get_bytes(uri))["campaign"]["evaluations"])
            if done >= 10:  # the initial design is in; LaMOO's batches are still to come
                break
        time.sleep(0.2)
    assert proc.poll() is None, log.read_text()[-3000:]
    os.killpg(proc.pid, signal.SIGKILL)  # the flow process and its local Dask workers
    proc.wait()
    assert 10 <= done < 20
    summary = tmp_path / "summary.json"
    resumed = cli(run_cli, cli_env, *args, summary=summary)
    assert "resuming" in resumed.stdout + resumed.stderr
    # the killed run's S3 lease on the campaign: its process on this machine is gone, taken over at once
    assert "test-kill: took the campaign over from nas flow run " in resumed.stdout + resumed.stderr
    assert ": its process is gone" in resumed.stdout + resumed.stderr
    out = " ".join(resumed.stdout.split())
    assert "no regression against the best of 1 earlier run(s) with these parameters" in out, out
    assert "all 1 metric(s) equal" in out, out  # the final hypervolume, as test-demo's
    state = json.loads(store.get_bytes(uri))["campaign"]
    ref = reference()
    assert [e["x"] for e in state["evaluations"]] == [e.x for e in ref.evaluations]
    assert json.loads(summary.read_text())["campaigns"][0]["hypervolume"] == pytest.approx(ref.score_trace()[-1])


def test_a_bad_parameter_fails_before_anything_runs(run_cli, cli_env):
    """Through a `paperline` process: exit status 1, one line on stderr (the other refusals, in
    process and without a stack: tests/flows/test_cli.py)."""
    proc = run_cli(cli_env, "run", "nas", "--preset", "demo", "--set", "optimizer=annealing")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    err = " ".join(proc.stderr.split())
    assert err.startswith("error: optimizer='annealing': unknown optimizer; known: alphax, bo,"), err


def test_evaluations_past_the_time_limit_are_recorded_as_failed(run_cli, cli_env, tmp_path, stack):
    summary = tmp_path / "summary.json"
    sets = ("problem=live-mnist", "live=null", "optimizer=random", "budget=2", "q=2", "n_init=2",
            f"campaign=timeout-{os.getpid()}")
    args = ["run", "nas", "--preset", "default", *[a for s in sets for a in ("--set", s)]]
    proc = run_cli(cli_env, *args, "--set", "evaluation_timeout_s=0.2", "--summary-json", str(summary))
    out = " ".join((proc.stdout + proc.stderr).split())
    # every evaluation failed: the run fails (it exited 0 with nothing learned, read as success: a
    # trial), saying why, and writes no summary; the MLflow parent run is FAILED
    assert proc.returncode == 1 and not summary.exists(), out[-2000:]
    assert "no successful evaluation yet" in out
    from paperline.infra.tracking import Tracker

    client = Tracker(stack[1].mlflow_tracking_uri).client
    parent = client.search_runs([client.get_experiment_by_name("nas").experiment_id],
                                filter_string=f"tags.mlflow.runName = 'timeout-{os.getpid()}'")
    assert [r.info.status for r in parent] == ["FAILED"], parent
    assert f"error: campaign 'timeout-{os.getpid()}': all 2 of its evaluations failed, so it found nothing (failed: " \
           "2 x timed out: not done 0.2 s after it started on its worker); its checkpoint keeps them" in out, out[-2000:]
    # the limit raised: the re-run resumes the complete campaign, and says what it will not do (a
    # trial read the same failed summary as the new limit not working)
    proc = run_cli(cli_env, *args, "--set", "evaluation_timeout_s=600")
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 1, out[-2000:]
    assert f"timeout-{os.getpid()}: 2 of its 2 evaluations timed out earlier; they are not run again (resume=false " \
           "starts the campaign over, with evaluation_timeout_s=600)" in out, out[-2000:]
    assert "complete (2/2 evaluations): nothing is left to evaluate" in out


def test_a_slow_optimizer_batch_is_said_while_it_is_chosen_and_a_quick_one_not(monkeypatch):
    """LaMOO's first batch of the demo took 10-70 s with nothing printed (a trial)."""
    import builtins
    import contextvars

    from paperline.flows.nas import said_while_slow

    run = contextvars.ContextVar("run", default="none")
    run.set("the flow run's")  # (Prefect's log_prints finds its flow run by context)
    lines: list[str] = []
    # printed by the print of the moment: Prefect's log_prints patches it during a flow run (the
    # builtin bound beforehand printed plain lines, missing from the run's logs)
    monkeypatch.setattr(builtins, "print", lines.append)
    with said_while_slow(lambda s: f"{run.get()} line after {s:.2f} s", first_s=0.05, every_s=0.05):
        deadline = time.monotonic() + 60
        while len(lines) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    said = list(lines)
    time.sleep(0.2)
    assert lines == said and len(said) >= 3  # none after the block
    seconds = [float(line.split()[-2]) for line in said]
    assert all(line.startswith("the flow run's line after") for line in said) and seconds == sorted(seconds)
    assert seconds[0] >= 0.05
    with said_while_slow(lambda s: "never", first_s=5, say=lines.append):
        pass
    assert lines == said


def test_a_changed_optimizer_default_names_a_new_campaign(monkeypatch):
    """The derived campaign name covers the optimizer's resolved options: after a release changes a
    default, the same parameters start a new campaign instead of failing on the old checkpoint
    (seen when LaMOO's kernel default changed); a name the user gave stays theirs."""
    from paperline.flows.nas import CampaignParameters
    from paperline.kernels.search.lamoo import LaMOO

    params = dict(optimizer="lamoo", problem="nasbench201-cifar10", objectives=["val_accuracy_pct", "model_size_mb"],
                  budget=20)
    before = CampaignParameters(**params).campaign_name()
    assert CampaignParameters(**{**params, "budget": 40}).campaign_name() == before  # the budget may grow
    monkeypatch.setattr(LaMOO, "defaults", {**LaMOO.defaults, "n_candidates": 1024})
    assert CampaignParameters(**params).campaign_name() != before
    assert CampaignParameters(**params, campaign="mine").campaign_name() == "mine"


def test_a_checkpoint_compares_problem_options_with_their_defaults():
    """levy with ``{}`` and with ``{"dim": 20}`` (its default) are one problem: a checkpoint
    conflict named them as differing (a trial); another dim still differs."""
    from paperline.flows.nas import _identity
    from paperline.kernels.search.campaign import Campaign

    def campaign(**problem_options):
        return Campaign("levy", "random", budget=4, n_init=2, problem_options=problem_options)

    def differ(a, b):
        return [k for k, x, y in _identity(a, b) if x != y]

    assert differ(campaign(), campaign(dim=20)) == []
    assert differ(campaign(), campaign(dim=30)) == ["problem_options/objectives"]


def test_a_long_candidate_is_shortened_with_a_marker():
    """A 20-dimensional point is shortened in the summary table, visibly (a user read the cut
    ``x11=1`` as the whole point); a short one and a NAS cell string are shown whole."""
    from paperline.flows.nas import _candidate_text

    long = _candidate_text({f"x{i}": 1.234567 * i for i in range(20)})
    assert len(long) == 120 and long.endswith("…") and long.startswith("x0=0, x1=1.235")
    assert _candidate_text({"x0": 0.5, "x1": 2}) == "x0=0.5, x1=2"
    assert _candidate_text({"cell": "|nor_conv_3x3~0|" * 10, "x0": 1.0}) == "|nor_conv_3x3~0|" * 10


def test_a_refused_problem_option_is_shown_as_given():
    """The value shown had the demo's objectives merged in, a key the user never typed (a trial)."""
    from paperline.flows.nas import CampaignParameters
    from paperline.kernels.errors import InputError

    params = CampaignParameters(optimizer="lamoo", problem="nasbench201-cifar10",
                                objectives=["val_accuracy_pct", "model_size_mb"], problem_options={"dim": -3})
    with pytest.raises(InputError) as caught:
        params.build()
    assert str(caught.value).startswith("problem_options={'dim': -3}: nasbench201-cifar10 has no option 'dim'")


def test_a_campaign_is_run_by_one_process_at_a_time(tmp_path):
    """Two runs of one campaign ran side by side from its checkpoint and logged every evaluation
    twice (a trial): the campaign is held by a lock the kernel releases however its holder ends."""
    from pathlib import Path

    from paperline.flows.nas import campaign_lock
    from paperline.infra.errors import InputError

    code = ("import sys, time; from pathlib import Path; from paperline.infra.locks import held_by_this_process\n"
            "with held_by_this_process(Path(sys.argv[1]) / 'locks' / 'nas-c1.lock'):\n"
            "    print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(InputError, match=rf"campaign='c1': is being run now by process {holder.pid} on this "
                                             rf"machine: wait for it"):
            with campaign_lock("c1", Path(tmp_path)):
                pass
        with campaign_lock("c2", Path(tmp_path)):  # another campaign is free
            pass
    finally:
        holder.kill()  # SIGKILL: no cleanup of its own
        holder.wait()
    with campaign_lock("c1", Path(tmp_path)):  # released with the process: resumed at once
        # and held by this one, named as the S3 lease names a run (the two messages differed: a review)
        with pytest.raises(InputError, match=rf"is being run now by a nas run outside Prefect \(process "
                                             rf"{os.getpid()}\) on this machine: wait"):
            with campaign_lock("c1", Path(tmp_path)):
                pass
        # the instant after a holder took the lock, before it wrote its name (it said "process ?")
        (Path(tmp_path) / "locks" / "nas-c1.lock").write_text("")
        with pytest.raises(InputError, match=r"is being run now by another process \(starting: it has not yet "
                                             r"written its name\) on this machine"):
            with campaign_lock("c1", Path(tmp_path)):
                pass


def test_a_campaign_run_on_another_machine_is_refused_until_its_lease_is_stale(stack, tmp_path):
    """The local lock does not see a run on another machine sharing the S3: the campaign's S3
    lease does, refusing at once (not waiting) while its holder renews it; a lease that the S3
    server's own clock says is older than stale_s is a dead holder's, taken over."""
    import socket
    from pathlib import Path

    from paperline.flows.nas import RUN_LEASE, campaign_lock
    from paperline.infra.errors import InputError
    from paperline.infra.storage import LeaseHeldError, ObjectStore

    _, info = stack
    store = ObjectStore.from_stack(info)
    prefix = f"s3://{info.data_bucket}/tests/nas-lease/{os.getpid()}-{time.time_ns()}"
    lease = f"{prefix}/c1/{RUN_LEASE}"
    other = json.dumps({"owner": "nas flow run brave-otter (0f3c)", "pid": 4242, "host": "gpu-node-7"}).encode()
    store.put_bytes_to(other, lease)
    with pytest.raises(InputError, match=r"^campaign='c1': is being run now by nas flow run brave-otter \(0f3c\) "
                                         r"\(pid 4242 on gpu-node-7\) \(its lease s3://.*/c1/\.run-lease\.json\)"):
        with campaign_lock("c1", Path(tmp_path), store, prefix):
            pass
    assert store.get_bytes(lease) == other  # (left as it was)
    assert store.lease_holder(lease) == "nas flow run brave-otter (0f3c) (pid 4242 on gpu-node-7)"  # (the CLI's check)
    assert store.lease_holder(f"{prefix}/c2/{RUN_LEASE}") is None
    with campaign_lock("c2", Path(tmp_path), store, prefix) as still_held:  # another campaign is free
        still_held()
        assert json.loads(store.get_bytes(f"{prefix}/c2/{RUN_LEASE}"))["host"] == socket.gethostname()
    assert not store.exists(f"{prefix}/c2/{RUN_LEASE}")  # released
    # a dead holder's lease, by the server's clock older than stale_s (+1 s for the second's
    # rounding: 4.2 s later the whole-second dates differ by 4 or more), then confirmed unchanged
    # for renew_s + poll_s on this clock
    taken = []
    time.sleep(4.2)
    assert store.lease_holder(lease, stale_s=2.0) is None
    started = time.monotonic()
    with store.lease(lease, "this run", wait=False, renew_s=0.5, stale_s=2.0, poll_s=0.2, on_takeover=taken.append):
        assert time.monotonic() - started >= 0.7
        assert json.loads(store.get_bytes(lease))["owner"] == "this run"
    assert len(taken) == 1 and taken[0].startswith("nas flow run brave-otter (0f3c) (pid 4242 on gpu-node-7): last "
                                                   "renewed ") and taken[0].endswith("s ago (the S3 server's clock)")
    store.put_bytes_to(other, lease)
    with pytest.raises(LeaseHeldError):  # (fresh again: refused, not waited for)
        with store.lease(lease, "this run", wait=False, renew_s=0.5, stale_s=2.0):
            pass
    store.delete(lease)


def test_a_seed_torch_cannot_take_is_refused_as_bad_input():
    """A seed of 2**64 passed validation and every evaluation failed on the workers ("Overflow
    when unpacking long long"), the campaign exiting 0 (a trial)."""
    from pydantic import ValidationError

    from paperline.flows.nas import NasParameters

    with pytest.raises(ValidationError, match="less than 9223372036854775808"):
        NasParameters(seed=2**64)
    assert NasParameters(seed=2**63 - 1).seed == 2**63 - 1


@pytest.mark.parametrize("sets, said", [
    (["campaign=my run"], "campaign='my run': characters ' ' are not allowed: a campaign name is letters, digits"),
    (["campaign=_x"], "campaign='_x': it must start with a letter or a digit"),
    # it named the parameter model's class ("... instance of CampaignParameters")
    (["live=live-mnist"], "live='live-mnist': Input should be a JSON object of its fields, e.g. {\"name\": value}"),
    # a live field as live.optimizer's checks name one (it was live[budget]: a trial)
    (['live={"budget": 0}'], "live.budget=0: Input should be greater than or equal to 1"),
])
def test_a_bad_campaign_name_or_live_value_is_said_in_words(sets, said, tmp_path):
    from typer.testing import CliRunner

    from paperline.flows.cli import app
    from paperline.infra.settings import get_settings

    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(app, ["run", "nas", *[a for s in sets for a in ("--set", s)]],
                                    env={"PAPERLINE_STATE_DIR": str(tmp_path / "state")})
    finally:
        get_settings.cache_clear()
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and said in text and "pattern" not in text and "Parameters" not in text, text
    assert not (tmp_path / "state").exists()


def test_a_zero_hypervolume_says_why():
    """A campaign printed "hypervolume 0" and nothing else (a trial): no evaluation had yet gone past
    the reference point in every objective."""
    from paperline.flows.nas import _zero_hypervolume_lines
    from paperline.kernels.search.campaign import Campaign

    campaign = Campaign("branin-currin", "random", budget=20, q=2, n_init=2, ref_point=[100.0, 10.0])
    x = campaign.ask()
    campaign.tell(x, [{"values": [150.0, 5.0], "error": None, "seconds": 0.1},  # (both minimized)
                      {"values": [50.0, 12.0], "error": None, "seconds": 0.1}])
    assert campaign.score_trace()[-1] == 0
    (line,) = _zero_hypervolume_lines(campaign)
    assert line.startswith("hypervolume 0: no successful evaluation is better than the reference point in every "
                           "objective (branin below 100, currin below 10)")
    campaign.tell(campaign.ask(), [{"values": [90.0, 9.0], "error": None, "seconds": 0.1}] * 2)
    assert campaign.score_trace()[-1] > 0 and _zero_hypervolume_lines(campaign) == []


def test_an_optimizer_of_the_wrong_objective_count_is_told_the_ways_on():
    """turbo on the demo's two NAS-Bench-201 objectives was told only "is single-objective; the
    problem has 2 objectives" (a trial): the optimizers of the other kind for the problem's space,
    and, where the problem chooses its objectives and the optimizer takes its space, a choice."""
    from paperline.flows.nas import CampaignParameters
    from paperline.kernels.errors import InputError

    def refusal(**kw):
        with pytest.raises(InputError) as caught:
            CampaignParameters(**kw).build()
        return str(caught.value)

    two = ["val_accuracy_pct", "model_size_mb"]
    said = refusal(optimizer="alphax", problem="nasbench201-cifar10", objectives=two)
    assert said.startswith("optimizer='alphax': is single-objective; the problem has 2 objectives; for several "
                           "objectives on nasbench201-cifar10: lamoo, ")
    assert "turbo" not in said.split(";")[2]  # (a box-space optimizer)
    assert said.endswith("or choose nasbench201-cifar10's objectives (of val_accuracy_pct, latency_s, model_size_mb), "
                         "e.g. --set 'objectives=[\"val_accuracy_pct\"]'")
    # turbo takes no categorical space: one objective would not help it
    assert "choose" not in refusal(optimizer="turbo", problem="nasbench201-cifar10", objectives=two)
    said = refusal(optimizer="lamoo", problem="levy")
    assert said.startswith("optimizer='lamoo': is multi-objective; the problem has one objective; for one objective on "
                           "levy: ") and "turbo" in said and "choose" not in said
