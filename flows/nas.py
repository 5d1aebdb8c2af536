"""The ``nas`` flow: NAS and black-box optimization campaigns (LaNAS, LA-MCTS, LaMOO, AlphaX and
the BoTorch/pymoo baselines).

A campaign asks its optimizer for a batch of ``q`` candidates, evaluates them in parallel as cached
tasks on the Dask workers, tells the optimizer, checkpoints the whole state to S3 and logs one
MLflow child run per evaluation under the campaign's parent run. A campaign killed at any point
resumes from its last checkpoint (run the flow again with the same parameters) and ends
identical to an uninterrupted run; evaluations finished after the last checkpoint come from the
task cache.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prefect.runtime import flow_run
from prefect.task_engine import TaskRunTimeoutError
from pydantic import Field, field_validator

from paperline.flows.pipelines import PipelineParameters
from paperline.infra.cluster import configure_local_workers, default_task_runner
from paperline.infra.device import resolve_device
from paperline.infra.errors import InputError, PaperlineError, name_problem
from paperline.infra.locks import Held, held_by_this_process, run_owner
from paperline.infra.pipeline_flow import pipeline_flow
from paperline.infra.regression import Headline, check_latest
from paperline.infra.settings import get_settings
from paperline.infra.stack import require_stack
from paperline.infra.storage import LeaseHeldError, LeaseLostError, ObjectStore
from paperline.infra.tracking import Tracker, prefect_run_tags
from paperline.kernels.errors import InputError as KernelInputError, unknown_name
from paperline.kernels.search.campaign import Campaign
from paperline.kernels.search.deadline import EvaluationTimeout
from paperline.kernels.search.problems import make_problem, problem_names, problem_option_names, resolved_problem_options
from paperline.tasks.nas import evaluate, load_checkpoint, log_evaluations, render_report, save_checkpoint

EXPERIMENT = "nas"


class CampaignParameters(PipelineParameters):
    """One campaign (rendered as a form in the Prefect UI)."""

    optimizer: str = Field("lamoo", description="random, lanas, lamcts, lamoo, alphax, bo, turbo, qehvi, qnehvi "
                                                "or nsga2.")
    problem: str = Field("nasbench201-cifar10", description="nasbench201-{cifar10,cifar100,imagenet16}, "
                                                            "live-mnist, branin-currin, vehicle-safety, dtlz2, "
                                                            "ackley, levy, rosenbrock.")
    objectives: list[str] | None = Field(None, min_length=1, description="NAS-Bench-201: the objectives to use, e.g. "
                                                           "val_accuracy_pct,model_size_mb (default: all three).")
    problem_options: dict[str, Any] = Field(default_factory=dict,
                                            description='Problem options, e.g. {"dim": 20} or {"epochs": 2}.')
    budget: int = Field(60, ge=1, description="Number of evaluations.")
    q: int = Field(5, ge=1, description="Batch size: candidates evaluated in parallel per step.")
    n_init: int = Field(10, ge=1, description="Initial Sobol design (the same for every optimizer).")
    # torch.manual_seed takes seeds below 2**64, and some optimizers add their batch count
    seed: int = Field(0, ge=0, lt=2**63, description="Seeds the design, the optimizer and the evaluations.")
    ref_point: list[float] | None = Field(None, description="Hypervolume reference point in the objectives' "
                                                            "units (default: the problem's).")
    optimizer_options: dict[str, Any] = Field(default_factory=dict,
                                              description='Optimizer hyperparameters, e.g. {"sampler": "nsga2"}.')
    campaign: str | None = Field(None, min_length=1, max_length=120,
                                 description="Campaign name: letters, digits, '.', '_', '-' (default: derived from "
                                             "the parameters above, budget excluded, and the optimizer's defaults); "
                                             "a checkpoint of that name is resumed.")
    resume: bool = Field(True, description="Resume the campaign's checkpoint when there is one.")

    @field_validator("campaign")
    @classmethod
    def _campaign(cls, v: str | None) -> str | None:
        if v is not None and (problem := name_problem(v, "campaign")):
            raise ValueError(problem)
        return v
    evaluation_timeout_s: float = Field(3600.0, gt=0, description="An evaluation not done this many seconds "
                                                                 "after it started on its worker is stopped and "
                                                                 "recorded as failed (timed out).")

    def problem_kwargs(self) -> dict[str, Any]:
        """The options handed to the problem: ``problem_options``, plus ``objectives`` when set,
        plus, for ``live-mnist`` without a ``device`` option, the workers' device (the ``device``
        setting, resolved).

        Raises:
            InputError: live-mnist with the ``device`` setting ``cuda`` and no usable CUDA device
                (:func:`paperline.infra.device.resolve_device`).
        """
        opts = dict(self.problem_options)
        if self.objectives is not None:
            opts["objectives"] = list(self.objectives)
        if self.problem == "live-mnist" and "device" not in opts:
            opts["device"] = resolve_device(get_settings().device)  # latency on the workers' device
        return opts

    def build(self) -> Campaign:
        """The campaign (validates every input). Raises InputError naming what is wrong."""
        if self.problem not in problem_names():
            raise InputError("problem", self.problem, unknown_name("problem", self.problem, problem_names()))
        if self.objectives is not None and "objectives" not in self.problem_options:
            if "objectives" not in problem_option_names(self.problem):
                takes = [n for n in problem_names() if "objectives" in problem_option_names(n)]
                raise InputError("objectives", self.objectives, f"{self.problem} has fixed objectives; only "
                                                                f"{', '.join(takes)} choose theirs (--set "
                                                                f"objectives=null, or start from --preset default)")
        try:
            return Campaign(self.problem, self.optimizer, budget=self.budget, q=self.q, seed=self.seed,
                            n_init=self.n_init, ref_point=self.ref_point, optimizer_options=self.optimizer_options,
                            problem_options=self.problem_kwargs())
        except KernelInputError as exc:
            argument, value = exc.argument, exc.value
            if argument == "problem_options.objectives" and "objectives" not in self.problem_options:
                argument = "objectives"  # the parameter the user set, not where it is passed on
            if argument == "problem_options" and isinstance(value, dict):  # as given: without the
                value = dict(self.problem_options)  # objectives/device merged in (a trial)
            raise InputError(argument, value, exc.problem + self._objective_count_hint(exc)) from None

    def _objective_count_hint(self, exc: KernelInputError) -> str:
        """The ways on from an optimizer refused for the problem's number of objectives: the
        optimizers of the other kind for this problem's space, and, where the problem chooses its
        objectives and the optimizer takes its space, a choice of objectives (a trial's turbo on the
        demo's two NAS-Bench-201 objectives was told only the count)."""
        if exc.argument != "optimizer" or "-objective; the problem has" not in exc.problem:
            return ""
        from paperline.kernels.search.base import OPTIMIZERS, optimizer_names  # noqa: PLC0415

        try:
            problem = make_problem(self.problem, **{k: v for k, v in self.problem_options.items() if k != "objectives"})
        except KernelInputError:
            return ""  # (its own error comes once the objectives are right)
        single = "is single-objective" in exc.problem
        kind = problem.space.kind
        others = [n for n in optimizer_names() if kind in OPTIMIZERS[n].spaces
                  and OPTIMIZERS[n].multi_objective in ((True, None) if single else (False, None))]
        hint = f"; for {'several objectives' if single else 'one objective'} on {self.problem}: {', '.join(others)}"
        if "objectives" in problem_option_names(self.problem) and kind in OPTIMIZERS[self.optimizer].spaces:
            names = [o.name for o in problem.objectives]
            example = json.dumps(names[:1] if single else names[:2])
            hint += (f"; or choose {self.problem}'s objectives (of {', '.join(names)}), e.g. --set "
                     f"'objectives={example}'")
        return hint

    def campaign_name(self, built: Campaign | None = None) -> str:
        """The campaign's name: ``campaign``, else derived from the parameters (``built``: this
        parameter set's :meth:`build`, when the caller has it already)."""
        if self.campaign:
            return self.campaign
        key = self.model_dump(exclude={"budget", "campaign", "resume", "evaluation_timeout_s"})
        # The optimizer's options as resolved (its defaults included): when a paperline release
        # changes a default, the same parameters name a new campaign instead of colliding with the
        # checkpoint of one run with the old defaults.
        key["resolved_optimizer_options"] = (built or self.build()).optimizer.options
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:10]
        return f"{self.problem}-{self.optimizer}-seed{self.seed}-{digest}"


class NasParameters(CampaignParameters):
    """The flow's parameters: one campaign, and optionally a live NAS campaign after it."""

    live: CampaignParameters | None = Field(None, description="A second campaign run after the first, e.g. "
                                                              "live NAS on MNIST-5k (problem live-mnist).")

    def campaigns(self) -> list[CampaignParameters]:
        """The campaigns to run, in order: the first (these parameters less ``live``), then
        ``live`` when given."""
        main = CampaignParameters(**self.model_dump(exclude={"live"}))
        return [main] + ([self.live] if self.live is not None else [])

    def validate_inputs(self) -> None:
        """Build every campaign (which validates every input) before anything starts, and check
        that the two campaigns' names differ.

        Raises:
            InputError: naming the parameter (``live.<name>`` for one of the live campaign's), or
                ``live`` when the live campaign has the same name as the first.
        """
        names = []
        for c in self.campaigns():
            try:
                names.append(c.campaign_name(c.build()))  # build() validates every input
            except InputError as exc:
                if c is self.live:  # `optimizer='nope'` did not say it was the live campaign's
                    raise InputError(f"live.{exc.argument}", exc.value, exc.problem) from None
                raise
        if len(set(names)) != len(names):
            raise InputError("live", names[-1], "the live campaign has the same name as the first; change it")

    def validate_on_stack(self, info: Any, store: ObjectStore) -> None:
        """Before the flow run is created: no other process runs the campaign now (checked again
        while the flow holds it), and a checkpoint to resume holds the same campaign."""
        for c in self.campaigns():
            built = c.build()
            prefix, name = campaigns_prefix(info.data_bucket), c.campaign_name(built)
            with campaign_lock(name, get_settings().state_dir):
                pass
            # (read only: taking the lease to check took over a stale one, and a run starting
            # elsewhere meanwhile was refused naming this check: a review)
            holder = store.lease_holder(f"{prefix}/{name}/{RUN_LEASE}")
            if holder is not None:
                raise _held_elsewhere(name, holder, f"{prefix}/{name}/{RUN_LEASE}")
            resumable(c, built, store, f"{prefix}/{c.campaign_name(built)}/checkpoint.json")


PRESETS: dict[str, dict[str, Any]] = {
    # the flow's own defaults (what the deployments run): start here for your own campaign
    "default": {},
    # LaMOO (qEHVI inside) on NAS-Bench-201 cifar10, accuracy against model size, then a short
    # live NAS on MNIST-5k: three objectives, trained on the workers.
    "demo": {"optimizer": "lamoo", "problem": "nasbench201-cifar10",
             "objectives": ["val_accuracy_pct", "model_size_mb"], "budget": 40, "q": 5, "n_init": 10,
             "live": {"optimizer": "lamoo", "problem": "live-mnist", "budget": 8, "q": 4, "n_init": 4,
                      "problem_options": {"epochs": 1}}},
    "full": {"optimizer": "lamoo", "problem": "nasbench201-cifar10",
             "objectives": ["val_accuracy_pct", "model_size_mb"], "budget": 200, "q": 10, "n_init": 20},
}


@pipeline_flow(name="nas", log_prints=True, task_runner=default_task_runner())
def nas(params: NasParameters | None = None) -> dict[str, Any]:
    """Run the campaign(s): batches evaluated in parallel on the workers, checkpointed to S3 after
    every batch, one MLflow parent run per campaign with one child run per evaluation.

    Returns:
        A summary: per campaign its Pareto front (or best point), hypervolume, counts and URLs;
        ``table`` and ``lines`` for the CLI; the Prefect and MLflow URLs.

    Raises:
        InputError: bad parameters (unknown optimizer or problem, budget < n_init, q < 1, a
        reference point no point dominates, ...). ServiceError: the stack is not up.
        CampaignFailed: every evaluation of a campaign failed (the campaigns after it do not run).
    """
    params = params or NasParameters()
    configure_local_workers()
    params.validate_inputs()
    settings = get_settings()
    info, store = require_stack(settings)
    tracker = Tracker(info.mlflow_tracking_uri)
    run_url = info.flow_run_url(flow_run.id)
    tags = prefect_run_tags(info)
    results = [run_one(c, store, tracker, campaigns_prefix(info.data_bucket), tags) for c in params.campaigns()]
    return _summary(results, run_url, str(flow_run.id), tracker)


def resumable(cp: CampaignParameters, campaign: Campaign, store: ObjectStore,
              checkpoint_uri: str) -> tuple[dict[str, Any] | None, Campaign | None]:
    """The checkpoint at ``checkpoint_uri`` and the campaign it holds (with ``cp``'s budget), or
    ``(None, None)`` when there is none or ``cp.resume`` is off.

    Raises:
        InputError: the checkpoint is not a campaign checkpoint (naming its URI), holds a campaign
            with other parameters than ``campaign``, or more evaluations than ``cp.budget``.
    """
    try:
        state = load_checkpoint(store, checkpoint_uri) if cp.resume else None
        if state is None:
            return None, None
        saved = Campaign.from_state(state["campaign"], budget=cp.budget)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:  # a bare JSONDecodeError or KeyError before
        why = f"no {exc} in it" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        raise InputError("checkpoint", checkpoint_uri, f"not a readable campaign checkpoint ({why}); resume=false "
                                                       "starts the campaign over under this name, replacing it") from exc
    differ = {k: (a, b) for k, a, b in _identity(saved, campaign) if a != b}
    if "optimizer" in differ:  # another optimizer's options differ too; saying so adds nothing
        differ.pop("optimizer_options", None)
    if "problem" in differ:  # the default reference point follows the problem (a trial read it as set)
        differ.pop("ref_point", None)
    if differ:
        # with the values: "other problem" alone sent a trial looking for what differed
        shown = ", ".join(f"{k} ({_short(b)} here, {_short(a)} in the checkpoint)" for k, (a, b) in differ.items())
        raise InputError("campaign", cp.campaign_name(campaign), f"a checkpoint of this name holds a campaign with "
                                                                 f"other {shown}; pick another name, or set "
                                                                 f"resume=false to start over under this one "
                                                                 f"(replacing that campaign's checkpoint)")
    if cp.budget < saved.n_done:  # it would end at once, reporting more evaluations than asked for
        raise InputError("budget", cp.budget, f"campaign {cp.campaign_name(campaign)!r} has already done "
                                              f"{saved.n_done} evaluations (its checkpoint); a budget of at least "
                                              f"that continues it, resume=false or another campaign name starts "
                                              f"a fresh one")
    return state, saved


def campaigns_prefix(data_bucket: str) -> str:
    """Where the campaigns' checkpoints go: ``s3://<data_bucket>/nas/campaigns`` (then
    ``<campaign name>/checkpoint.json``)."""
    return f"s3://{data_bucket}/nas/campaigns"


RUN_LEASE = ".run-lease.json"  # beside a campaign's checkpoint while a run holds the campaign


@contextlib.contextmanager
def campaign_lock(name: str, state_dir: Path, store: ObjectStore | None = None,
                  prefix: str | None = None) -> Iterator[Callable[[], None]]:
    """Hold campaign ``name`` for this run: a second flow run of the same campaign is refused,
    on this machine or (given ``store`` and ``prefix``, the campaigns' S3 prefix) on any machine
    sharing the S3 (two ran side by side from one checkpoint and logged every evaluation twice in
    one MLflow run: a trial).

    On this machine: a lock on ``<state dir>/locks/nas-<name>.lock`` that the kernel releases when
    the process ends, however it ends (a ``kill -9``'d run resumes at once;
    :func:`paperline.infra.locks.held_by_this_process`). Across machines: the S3 lease
    ``<prefix>/<name>/.run-lease.json`` (:meth:`paperline.infra.storage.ObjectStore.lease`,
    not waited for), renewed every 10 s; a holder that died on another machine is taken over
    about a minute after its last renewal (:meth:`~paperline.infra.storage.ObjectStore.lease`).

    Yields:
        A check to call before each checkpoint write: it raises ``PaperlineError`` when the S3
        lease was lost (a no-op without ``store``).

    Raises:
        InputError: naming ``campaign`` and the run that holds it.
    """
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(held_by_this_process(state_dir / "locks" / f"nas-{name}.lock", _run_owner()))
        except Held as exc:
            # (named as the S3 lease names its holder: the two messages named a process and a flow run)
            # (a holder that has not yet written its name, the instant after it took the lock: not "process ?")
            holder = f"process {exc.holder}" if exc.holder.isdigit() else \
                "another process (starting: it has not yet written its name)" if exc.holder == "?" else exc.holder
            raise InputError("campaign", name, f"is being run now by {holder} on this machine: wait for it to end, "
                                               "or stop it (Ctrl-C in its terminal; a deployment's run: cancel its "
                                               "flow run in the Prefect UI) and run this again to resume from its "
                                               "checkpoint") from None
        check: Callable[[], None] = lambda: None  # noqa: E731
        if store is not None and prefix is not None:
            def taken_over(why: str) -> None:
                print(f"{name}: took the campaign over from {why}")

            try:
                check = held.enter_context(store.lease(f"{prefix}/{name}/{RUN_LEASE}", _run_owner(), wait=False,
                                                       on_takeover=taken_over))
            except LeaseHeldError as exc:
                raise _held_elsewhere(name, exc.holder, exc.uri) from None
        yield check


def _held_elsewhere(name: str, holder: str, uri: str) -> InputError:
    return InputError("campaign", name, f"is being run now by {holder} (its lease {uri}): wait for it to end, or "
                                        "stop it and run this again to resume from its checkpoint (a run that died "
                                        "without releasing it is taken over about a minute after its last renewal)")


class CampaignTakenOver(PaperlineError):
    """Another run took this run's campaign over (its S3 lease went unrenewed): this run stops
    before writing the campaign's checkpoint; the other continues the campaign and its MLflow
    run."""


def _run_owner() -> str:
    """This run in words (:func:`paperline.infra.locks.run_owner`)."""
    return run_owner("nas")


def run_one(cp: CampaignParameters, store: ObjectStore, tracker: Tracker, prefix: str,
            tags: dict[str, str]) -> dict[str, Any]:
    """One campaign to its budget, resuming its checkpoint when there is one; the campaign is held
    by this run meanwhile (:func:`campaign_lock`)."""
    campaign = cp.build()
    name = cp.campaign_name(campaign)
    with campaign_lock(name, get_settings().state_dir, store, prefix) as still_held:
        return _run_one(cp, campaign, name, store, tracker, prefix, tags, still_held)


def _run_one(cp: CampaignParameters, campaign: Campaign, name: str, store: ObjectStore, tracker: Tracker,
             prefix: str, tags: dict[str, str], still_held: Callable[[], None]) -> dict[str, Any]:
    checkpoint_uri = f"{prefix}/{name}/checkpoint.json"
    state, saved = resumable(cp, campaign, store, checkpoint_uri)
    parent_id = None

    def checkpoint() -> None:  # the whole campaign and its MLflow parent run, in one PUT
        save_checkpoint(store, checkpoint_uri, {"campaign": campaign.state_dict(), "mlflow_parent_run_id": parent_id})
    if state is not None:
        campaign = saved
        parent_id = state.get("mlflow_parent_run_id")
        print(f"{name}: resuming from {checkpoint_uri} after {campaign.n_done} evaluations" if campaign.n_done else
              f"{name}: resuming from {checkpoint_uri}, written before its first batch ended")
        for note in resume_notes(name, campaign, cp):
            print(note)
    if parent_id and tracker.run_exists(parent_id):
        tracker.set_tags(parent_id, tags)  # this flow run's id first: a RUNNING run of a crashed one is ended
        tracker.reopen_run(parent_id)
        # a kill between the checkpoint and the MLflow logging of a batch: log what is missing
        logged = {int(t["paperline.evaluation_index"]) for t in tracker.child_run_tags(EXPERIMENT, parent_id)
                  if "paperline.evaluation_index" in t}
        missing = [e for e in campaign.evaluations if e.index not in logged]
        if missing:
            log_evaluations(tracker, EXPERIMENT, parent_id, campaign, missing, tags)
    else:
        parent_id = tracker.start_run(EXPERIMENT, run_name=name, tags={**tags, "paperline.campaign": name},
                                      params={**cp.model_dump(exclude={"live"}), "campaign": name,
                                              "problem_options": json.dumps(campaign.problem.options),
                                              "ref_point_used": campaign.ref_point_user})
        log_evaluations(tracker, EXPERIMENT, parent_id, campaign, campaign.evaluations, tags)  # after a lost run
        # checkpointed at once, with its MLflow run: a run stopped before its first batch left an
        # empty KILLED parent run, and the re-run started a second one of the same name (a trial)
        checkpoint()
    # MLflow parameters cannot change, so a campaign resumed with a larger budget says so in a tag
    tracker.set_tags(parent_id, {**tags, "checkpoint": checkpoint_uri, "paperline.budget": cp.budget})
    # An evaluation keeps its own time limit from its start on its worker (checked between its
    # steps: kernels/search/deadline.py). Prefect's task limit, a little later, and the flow's
    # deadline below are backstops for one stuck in a long C call: Prefect's exception into the
    # worker's thread was lost in a callback once (a trial), and the flow's deadline counts from
    # the batch's submission, allowing for evaluations queued behind others.
    timeout = cp.evaluation_timeout_s
    # (the grace covers a cold worker's loading, which the evaluation's own limit does not count:
    # Prefect's 10.5 s stopped a first 0.5-s evaluation still importing torch under load, a trial)
    grace = max(60.0, 0.1 * timeout)
    bounded = evaluate.with_options(timeout_seconds=timeout + grace)
    try:
        while not campaign.done:
            # a model-based optimizer's batch takes seconds to a minute (LaMOO's first on the demo:
            # ~10 s on an idle host, 56-70 s under load, silent: a trial)
            with said_while_slow(lambda s: f"{name}: {campaign.optimizer.name} is choosing the next "
                                           f"{campaign.next_batch_size} candidates after "
                                           f"{campaign.n_done} evaluations ({s:.0f} s so far)"):
                x = campaign.ask()
            start = campaign.n_done
            futures = [bounded.submit(campaign.problem.name, campaign.problem.options, [float(v) for v in row],
                                       campaign.seed, start + i, timeout) for i, row in enumerate(x)]
            allowed = len(futures) * (timeout + grace)  # (all queued on one worker, at worst)
            deadline = time.monotonic() + allowed
            results = [_result(f, deadline, allowed, timeout) for f in futures]
            new = campaign.tell(x, results)
            try:
                still_held()  # (a run that lost the campaign to another does not write over its checkpoint)
            except LeaseLostError as exc:
                if not exc.taken_over:
                    raise
                raise CampaignTakenOver(f"campaign {name!r}: another run took it over while this one evaluated "
                                        f"(this run's lease went unrenewed): this run stopped before writing the "
                                        f"checkpoint; the other continues the campaign") from None
            checkpoint()
            log_evaluations(tracker, EXPERIMENT, parent_id, campaign, new, tags)
            print(f"{name}: {campaign.n_done}/{campaign.budget} evaluations, {_score_text(campaign)}")
        _log_report(tracker, parent_id, campaign, name)
        if not any(e.ok for e in campaign.evaluations):  # exit 0 with nothing learned read as success (a trial)
            raise CampaignFailed(f"campaign {name!r}: all {campaign.n_done} of its evaluations failed, so it found "
                                 f"nothing ({'; '.join(failure_lines(campaign))}); its checkpoint keeps them: "
                                 "resume=false starts it over")
        identity = {**cp.model_dump(exclude={"live", "campaign", "resume", "evaluation_timeout_s"}),
                    "problem_options": campaign.problem.options}
        # a re-run continues the campaign's own run: there may be nothing earlier to compare with
        note = ("resumed this campaign's own run from its checkpoint: no other finished run with these "
                "parameters to compare with (resume=false starts a fresh one)") if state is not None else None
        versus = check_latest(tracker, parent_id, identity, _headlines(campaign), label=name, first_run_note=note)
        tracker.end_run(parent_id, "FINISHED")
    except BaseException as exc:
        if not isinstance(exc, CampaignTakenOver):  # (its MLflow run is the other run's now: a review)
            tracker.end_failed(parent_id, exc)
        raise
    return {"name": name, "campaign": campaign, "parent_run_id": parent_id, "checkpoint": checkpoint_uri,
            "versus": versus}


class CampaignFailed(PaperlineError):
    """A campaign whose evaluations all failed: the run fails (its MLflow parent run FAILED),
    naming the failures; the checkpoint keeps them."""


@contextlib.contextmanager
def said_while_slow(line: Callable[[float], str], first_s: float = 10.0, every_s: float = 30.0,
                    say: Callable[[str], Any] | None = None) -> Iterator[None]:
    """``say`` (print) ``line(seconds so far)`` once the block has run ``first_s`` seconds, then every
    ``every_s`` seconds until it ends; a quick block prints nothing. The printing thread runs in
    the caller's context, so in a flow run (``log_prints``) the line is the run's log line, in the
    Prefect UI too."""
    import contextvars  # noqa: PLC0415
    import threading  # noqa: PLC0415

    done = threading.Event()
    started = time.monotonic()

    def tell() -> None:
        wait = first_s
        while not done.wait(wait):
            (say or print)(line(time.monotonic() - started))  # (print looked up now: Prefect's log_prints patches it)
            wait = every_s

    thread = threading.Thread(target=contextvars.copy_context().run, args=(tell,), name="paperline-slow-notice",
                              daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)  # (a line blocked in a log handler does not hold the flow up: a review)


def _headlines(c: Campaign) -> list[Headline]:
    """A campaign is judged by its final hypervolume (several objectives) or best value (one, in its
    own direction) against the best earlier campaign of the same parameters: 2% worse is flagged."""
    if c.problem.n_objectives > 1:
        return [Headline("final_hypervolume", higher_is_better=True, tolerance=0.02)]
    return [Headline("final_best", higher_is_better=c.problem.objectives[0].maximize, tolerance=0.02)]


def _short(value: Any, limit: int = 60) -> str:
    """``value``'s repr, cut to about ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _identity(a: Campaign, b: Campaign) -> list[tuple[str, Any, Any]]:
    """What must match for a checkpoint to continue a campaign (the budget may grow). Problem
    options are compared with their defaults filled in (``{}`` against ``{"dim": 20}`` for levy
    was named as a difference: a trial)."""
    sa, sb = a.state_dict(), b.state_dict()

    def options(c: Campaign) -> str:
        return json.dumps(resolved_problem_options(c.problem.name, c.problem.options), sort_keys=True, default=str)

    return [("optimizer", a.optimizer.name, b.optimizer.name), ("optimizer_options", sa["optimizer"]["options"],
             sb["optimizer"]["options"]), ("problem", a.problem.name, b.problem.name),
            ("problem_options/objectives", options(a), options(b)),
            ("q", a.q, b.q), ("seed", a.seed, b.seed), ("n_init", a.n_init, b.n_init),
            ("ref_point", a.ref_point_user, b.ref_point_user)]


def _result(future: Any, deadline: float, allowed_s: float, limit_s: float) -> dict[str, Any]:
    """An evaluation's result by ``deadline`` (``time.monotonic``). A task that failed even after
    its retry, that stopped at its own limit ``limit_s`` (:class:`EvaluationTimeout`), or is not
    done in time (stuck in a C call past its own limit and Prefect's), is recorded as failed
    (``seconds``: its limit) and the campaign goes on."""
    try:
        return future.result(timeout=max(0.0, deadline - time.monotonic()))
    except KernelInputError:
        raise
    except EvaluationTimeout as exc:
        return {"values": None, "error": str(exc), "seconds": limit_s}
    except TaskRunTimeoutError as exc:  # (Prefect's backstop: read as the flow's own deadline before, a trial)
        return {"values": None, "error": f"timed out: stopped by Prefect's task limit ({exc})", "seconds": limit_s}
    except TimeoutError:
        return {"values": None, "error": f"timed out: not done {allowed_s:g} s after its batch started (stuck past "
                                         "its own limit)", "seconds": limit_s}
    except Exception as exc:  # noqa: BLE001 - a lost worker: recorded, the campaign goes on
        return {"values": None, "error": f"task failed: {type(exc).__name__}: {exc}", "seconds": 0.0}


def failure_lines(c: Campaign, kinds: int = 3) -> list[str]:
    """The failed evaluations' errors, counted by kind, most frequent first (the summary said how
    many failed, not why: the reason was only in each child run's ``paperline.error`` tag)."""
    counts = collections.Counter(e.error for e in c.evaluations if not e.ok).most_common()
    lines = [f"failed: {n} x {error if len(error) <= 160 else error[:159] + '…'}" for error, n in counts[:kinds]]
    if len(counts) > kinds:
        rest = counts[kinds:]
        lines.append(f"failed: {sum(n for _, n in rest)} more, of {len(rest)} other kind(s) (each child run's "
                     "paperline.error tag says)")
    return lines


def resume_notes(name: str, campaign: Campaign, cp: CampaignParameters) -> list[str]:
    """What a resumed campaign will not do: run its timed-out evaluations again (a trial raised
    ``evaluation_timeout_s`` after every evaluation timed out, and the re-run re-reported the
    same failed campaign), or anything at all when it is complete."""
    notes = []
    timed_out = sum(1 for e in campaign.evaluations if not e.ok and "timed out" in (e.error or "").lower())
    if timed_out:
        notes.append(f"{name}: {timed_out} of its {campaign.n_done} evaluations timed out earlier; they are not run "
                     f"again (resume=false starts the campaign over, with evaluation_timeout_s="
                     f"{cp.evaluation_timeout_s:g})")
    if campaign.done:
        notes.append(f"{name}: complete ({campaign.n_done}/{campaign.budget} evaluations): nothing is left to "
                     "evaluate; a larger budget continues it, resume=false starts it over")
    return notes


def _score_text(c: Campaign) -> str:
    if not any(e.ok for e in c.evaluations):
        return "no successful evaluation yet"
    if c.problem.n_objectives > 1:
        return f"hypervolume {c.score_trace()[-1]:.6g}"
    return f"best {c.problem.objectives[0].name} {c.best_trace()[-1]:.6g}"  # the objective's own units and sign


def _zero_hypervolume_lines(c: Campaign) -> list[str]:
    """Why a multi-objective campaign with successful evaluations has a hypervolume of 0: none of
    them is better than the reference point in every objective (a trial's campaign printed
    "hypervolume 0" and nothing else)."""
    if c.problem.n_objectives < 2 or not c.ref_point_user or not any(e.ok for e in c.evaluations):
        return []
    if c.score_trace()[-1] > 0:
        return []
    bounds = ", ".join(f"{o.name} {'above' if sign > 0 else 'below'} {ref:.6g}"
                       for o, sign, ref in zip(c.problem.objectives, c.problem.signs, c.ref_point_user))
    return [f"hypervolume 0: no successful evaluation is better than the reference point in every objective "
            f"({bounds}) yet; more evaluations may get there, or a reference point they reach (--set "
            "'ref_point=[...]', in the objectives' order and units) measures the front"]


def _log_report(tracker: Tracker, run_id: str, campaign: Campaign, name: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for fname, data in render_report(campaign, name).items():
            path = Path(tmp) / fname
            path.write_bytes(data)
            tracker.log_artifact(run_id, str(path))
    # (failed_evaluations is a curve over the evaluations, logged with each batch: a final point at
    # step 0 here drew it back to the start, a trial)
    metrics: dict[str, float] = {"evaluations": campaign.n_done}
    if any(e.ok for e in campaign.evaluations):
        if campaign.problem.n_objectives > 1:
            metrics["final_hypervolume"] = float(campaign.score_trace()[-1])
        else:  # in the objective's units and sign (a minimized objective stays positive)
            metrics["final_best"] = float(campaign.best_trace()[-1])
    tracker.log_metrics(run_id, metrics)


def options_table() -> tuple[str, list[str], list[list[str]]]:
    """(title, columns, rows) of every optimizer's options and defaults, for `paperline params nas`."""
    from paperline.kernels.search.base import OPTIMIZERS, optimizer_names

    rows = []
    for name in optimizer_names():
        cls = OPTIMIZERS[name]
        kind = {True: "multi", False: "single", None: "any"}[cls.multi_objective]
        head = [name, kind, "/".join(cls.spaces)]
        for option, default in cls.defaults.items():
            rows.append([*head, option, json.dumps(default), cls.option_help.get(option, "")])
            head = ["", "", ""]
        if not cls.defaults:
            rows.append([*head, "-", "", "no options"])
    return ("optimizer_options (JSON, e.g. --set 'optimizer_options={\"cp\": 0.5}')",
            ["optimizer", "objectives", "spaces", "option", "default", "what it does"], rows)


def _candidate_text(params: dict[str, Any]) -> str:
    """A candidate in one short string: its cell/arch string when the problem gives one."""
    for key in ("cell", "arch"):
        if key in params:
            return str(params[key])
    text = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())
    return text if len(text) <= 120 else text[:119] + "…"  # the whole point is in the JSON summary and MLflow


def _summary(results: list[dict[str, Any]], run_url: str, flow_run_id: str, tracker: Tracker) -> dict[str, Any]:
    rows, lines, campaigns = [], [], []
    for r in results:
        c: Campaign = r["campaign"]
        names = [o.name for o in c.problem.objectives]
        front = c.pareto_front()
        if c.problem.n_objectives == 1 and front:
            front = [max(front, key=lambda e: e.values[0] * c.problem.signs[0])]
        for e in front:
            rows.append([r["name"], str(e.index), ", ".join(f"{n}={v:.6g}" for n, v in zip(names, e.values)),
                         _candidate_text(e.params)])
        failed = sum(not e.ok for e in c.evaluations)
        lines.append(f"{r['name']}: {c.optimizer.name} on {c.problem.name}, {c.n_done} evaluations "
                     f"({failed} failed), {_score_text(c)}"
                     # shown to 6 significant digits ([87.2360000024414, 1.6847006000000002]: a trial)
                     + (f" (reference point [{', '.join(f'{v:.6g}' for v in c.ref_point_user)}])"
                        if c.ref_point_user else ""))
        lines += [f"  {line}" for line in failure_lines(c)]
        lines += [f"  {line}" for line in _zero_hypervolume_lines(c)]
        lines.append(f"  MLflow parent run: {tracker.run_url(r['parent_run_id'])}; checkpoint: {r['checkpoint']}")
        lines += [f"  {line}" for line in r["versus"].lines()]
        trace = c.score_trace()
        campaigns.append({"name": r["name"], "optimizer": c.optimizer.name, "problem": c.problem.name,
                          "evaluations": c.n_done, "failed": failed, "objectives": names,
                          "score": float(trace[-1]) if trace.size else None,
                          "hypervolume": float(trace[-1]) if trace.size and c.problem.n_objectives > 1 else None,
                          "pareto_front": [{"index": e.index, "values": e.values, "params": e.params} for e in front],
                          "mlflow_parent_run_id": r["parent_run_id"], "checkpoint": r["checkpoint"],
                          "versus_best_earlier": r["versus"].as_dict()})
    first = results[0]["parent_run_id"]
    return {"campaigns": campaigns,
            "table": {"title": "nas: each campaign's Pareto front (its best point when it has one objective)",
                      "columns": ["campaign", "evaluation", "objectives", "candidate"], "rows": rows},
            "lines": lines, "prefect_flow_run_id": flow_run_id, "prefect_flow_run_url": run_url,
            "mlflow_run_id": first, "mlflow_run_url": tracker.run_url(first)}
