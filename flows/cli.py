"""The ``paperline`` command line: up, down, status, env, datasets, params, run, demo, serve, worker, compare.

Errors are one clear line and a non-zero exit code; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import sys
import types
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from paperline.infra.errors import PaperlineError
from paperline.infra.errors import no_unfinished_finish as _no_unfinished_finish  # (also in a run's process)
from paperline.infra.errors import EXPECTED as EXPECTED_ERROR
from paperline.infra.worker_exit import short_event_failure
from paperline.infra.summary import fmt as _fmt  # (also in a deployment run's logs: infra/summary.py)
from paperline.kernels.errors import ClusterLost
from paperline.kernels.errors import InputError as KernelInputError

def _plain_types(params: list[Any]) -> list[Any]:
    """Typer 0.29's help prints each parameter's Python type beside it: ``<bool>`` beside flags that
    take no value (``--help``, ``--log``: read as if they wanted ``true``) and ``<str>`` beside
    arguments whose metavar already says what they take, and braces around a required argument
    in the usage line (``compare [OPTIONS] {EXPERIMENT}``, braces usually listing choices). Those
    show no type, and a required argument its bare name, as click writes it; options with a value
    keep their metavar (``--top N``)."""
    for param in params:
        if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
            param.metavar = ""
        elif isinstance(param, TyperArgument) and param.metavar is not None:
            param.display_type_rich = lambda ctx: None
            if param.required and param.nargs == 1:
                param._usage_display_name = lambda name=param.metavar: name
    return params


# options users reached for that a command does not have, with what it has instead (click's
# guess for `compare --sort` was "Possible options: --out": a trial)
OPTION_HINTS = {
    "compare": {**dict.fromkeys(("--sort", "--sort-by", "--order-by", "--rank"),
                                "runs are sorted by the first --metric (--ascending flips it)"),
                **dict.fromkeys(("--limit", "--last", "--max", "-n"), "--top N shows at most N runs")},
    "run": dict.fromkeys(("--param", "--params", "-p", "--parameter", "--override", "--option"),
                         "--set KEY=VALUE sets a parameter (repeatable; `paperline params PIPELINE` lists them)"),
    # paperline's own options, given after a command (only "No such option: --debug" before: a trial)
    "*": {"--debug": "it is paperline's own option: give it before the command (`paperline --debug COMMAND ...`)"},
}


class _Command(TyperCommand):
    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_types(super().get_params(ctx))

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        """Click's parsing, with :data:`OPTION_HINTS`' advice for an option the command lacks."""
        from typer import _click  # noqa: PLC0415 - typer's own copy of click, whose errors it raises

        try:
            return super().parse_args(ctx, args)
        except _click.exceptions.NoSuchOption as exc:
            hint = OPTION_HINTS.get(self.name or "", {}).get(exc.option_name) or OPTION_HINTS["*"].get(exc.option_name)
            if hint:
                exc.possibilities = None
                exc.message = f"No such option: {exc.option_name}: {hint}"
            raise


class _Group(TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_types(super().get_params(ctx))


app = typer.Typer(cls=_Group, help="paperline: systems papers as Prefect flows on Dask, tracked in MLflow, artifacts in S3.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode="markdown")  # docstring lines reflow into paragraphs
# Prefect's client printed a usage-data notice on a terminal (and would report to a server with
# analytics on); the local servers run with analytics off, and so does the client here.
os.environ.setdefault("DO_NOT_TRACK", "1")
# Tables hold URLs: never narrower than 140 columns, even when piped (rich's default is 80).
console = Console(width=max(140, Console().width))
err_console = Console(stderr=True, width=max(140, Console(stderr=True).width))
_state = {"debug": False}
# the pipelines' names, for `run --help` and `params --help` (tests/flows/test_cli.py checks the list
# against the registry, which is not imported here: it loads every pipeline's module)
PIPELINE_HELP = ("Pipeline name: compressed-training, gemm, nas, tensor-factorization or video-curation, "
                 "or one an installed package adds (README, \"Your own pipeline\"; `paperline params` "
                 "lists them all, `paperline params PIPELINE` its parameters).")


def _print_version(given: bool) -> None:
    """``--version``: paperline's version (its installed distribution's) and the versions of the
    libraries a bug report needs, then exit (there was no such option: a trial)."""
    if not given:
        return
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    print(f"paperline {of('paperline')}")
    print(", ".join(f"{name} {of(name)}" for name in ("prefect", "dask", "distributed", "mlflow", "torch", "numpy")))
    raise typer.Exit()


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
          _version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                        help="Print paperline's version and its main libraries', then exit.")) -> None:
    _state["debug"] = debug
    if debug:  # flow runs in subprocesses (serve, worker) keep their tracebacks too
        import os

        from paperline.infra.errors import DEBUG_ENV

        os.environ[DEBUG_ENV] = "1"


def _friendly(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except Exception as exc:  # noqa: BLE001 - the CLI's one place to turn errors into a line
            if _state["debug"]:
                raise
            _say_error(exc)
            raise typer.Exit(1) from None

    return wrapper


def _say_error(exc: Exception, prefix: str = "") -> None:
    """``error: <prefix><what went wrong>`` on stderr: paperline's own errors as their message,
    any other as its type and message (and a hint to --debug for its traceback)."""
    known = isinstance(exc, (PaperlineError, KernelInputError, ClusterLost))
    # (Dask's cancelled futures of a lost worker or scheduler were bare: a trial on a cluster of its own)
    msg = str(exc) if known else _with_dask_words(f"{type(exc).__name__}: {exc}")
    if not known and "scheduler-connection-lost" in msg:
        msg += ("; here the run's client lost the Dask scheduler (stopped, or the network failed): "
                "`paperline status` checks it, and the same command runs again once it is back")
    refused = None if known else _unauthorized(exc)
    if refused:  # a bare 401 said nothing of why (a trial: the stack's login made anew under `serve`)
        known, msg = True, refused
    from rich.markup import escape  # noqa: PLC0415 - messages may hold [brackets] (paths, C++ sources)

    if not getattr(sys.stderr, "at_line_start", True):  # Prefect's "--- Error logging to API ---"
        sys.stderr.write("\n")  # text ends without one: the error was glued onto it (a trial)
    err_console.print(f"[bold red]error:[/] {escape(prefix + msg)}", highlight=False, soft_wrap=True)
    if not known:
        err_console.print("(run with --debug for the traceback)", style="dim")


def _unauthorized(exc: BaseException) -> str | None:
    """The line for an error that is (or wraps) a server's 401: Prefect's client (httpx) or
    MLflow's (``... error code 401 ...``); None for any other error."""
    import httpx

    seen: list[BaseException] = [exc]
    while seen:
        e = seen.pop()
        if isinstance(e, httpx.HTTPStatusError) and e.response.status_code == 401:
            where = _prefect_at(str(e.request.url))
        elif type(e).__name__ == "MlflowException" and "error code 401" in str(e):
            where = "MLflow"
        else:
            seen += [x for x in (e.__cause__, e.__context__, *getattr(e, "exceptions", ())) if x is not None]
            continue
        return _not_authorized(where)
    return None


def _prefect_at(url: str) -> str:
    """``Prefect at scheme://host:port`` for a Prefect URL (any login in it left out)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return f"Prefect at {parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}"


def _not_authorized(where: str) -> str:
    return (f"not authorized (HTTP 401): {where} refused this process's login. The local stack's logins "
            "change when `paperline up` makes new ones (a login file deleted or edited): restart this command, "
            "and log in to the UIs again; for a configured server check PREFECT_API_AUTH_STRING or "
            "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD")


def _say(line: str) -> None:
    """One plain line on the terminal (no markup, no highlighting: ids and paths as they are)."""
    console.print(line, soft_wrap=True, highlight=False, markup=False)


def _settings():
    from rich.markup import escape

    from paperline.infra.settings import get_settings, unknown_variables

    settings = get_settings()
    if not _warned_variables:  # once per command
        _warned_variables.append(True)
        for line in unknown_variables():
            err_console.print(f"[yellow]warning: {escape(line)}[/]", soft_wrap=True, highlight=False)
    return settings


_warned_variables: list[bool] = []


def _ensure_stack(say_reused: bool = False):
    """The stack, started where needed (saying so); ``say_reused``: also say when it was all running."""
    from paperline.infra.stack import activate, ensure_stack

    settings = _settings()
    with console.status("starting the local stack (S3, Prefect, MLflow)...") as status:
        info = ensure_stack(settings, progress=lambda msg: status.update(msg),
                            notice=lambda msg: console.print(msg, highlight=False, soft_wrap=True))
    # what this call started (under the stack's lock): two `up`s at once both said they started it
    started = [s for s in info.services if s.name in info.started]
    if started:
        console.print(f"started the local stack in {settings.state_dir} (stop it with `paperline down`): "
                      + ", ".join(f"{s.name} {s.url}" for s in started), soft_wrap=True)
    elif say_reused and not any(s.managed for s in info.services):  # "already up" read as if a local one ran
        console.print("every service is a configured endpoint (checked; nothing local to start)", soft_wrap=True)
    elif say_reused:  # a second `up` printed the same table as the first, without saying it did nothing
        console.print(f"the stack in {settings.state_dir} is already up: nothing started", soft_wrap=True)
    activate(info)
    return info


@app.command(cls=_Command)
@_friendly
def up() -> None:
    """Start the local stack (or check the configured endpoints) and print each service's URL."""
    try:
        info = _ensure_stack(say_reused=True)
    except KeyboardInterrupt:  # it exited 130 without a word (a trial)
        _say("interrupted: the servers this `up` had started are stopped again (those running before are left)")
        raise
    _print_services(info.services)
    from paperline.infra.errors import redact_url
    from paperline.infra.stack import LOGIN_FILES

    state = _settings().state_dir
    prefect_login = (f" (it asks for a login: the line in {state / LOGIN_FILES['prefect']})"
                     if info.prefect_login else "")
    mlflow_login = (f" (user name and password: the two halves of the line in {state / LOGIN_FILES['mlflow']})"
                    if info.mlflow_login else "")
    console.print(f"S3:         {info.s3_endpoint_url}\nPrefect UI: {redact_url(info.prefect_ui_url)}{prefect_login}\n"
                  f"MLflow UI:  {redact_url(info.mlflow_tracking_uri)}{mlflow_login}", soft_wrap=True)


@app.command(cls=_Command)
@_friendly
def down() -> None:
    """Stop the local servers this state directory started (by PID)."""
    from paperline.infra.flow_runs import local_worker_pids, serve_lock_holder
    from paperline.infra.stack import running_local_stack, running_flow_runs, stop_stack

    settings = _settings()
    info = running_local_stack(settings)
    running = running_flow_runs(info) if info is not None else []
    workers = local_worker_pids(info.prefect_api_url, info.prefect_login) if info is not None else []
    dead: list[str] = []
    stopped = stop_stack(settings, dead)
    # said once stopped, by the `down` that stopped it (of two at once, the other said it too and
    # then "nothing to stop": a trial)
    if running and stopped:  # stopped under a run, the run failed minutes later with a bare ConnectError (a trial)
        console.print(f"[yellow]stopped the stack under {len(running)} Running flow run(s): {', '.join(running)}; "
                      "a `paperline run` among them stops about 10 s after its servers went down unless `paperline "
                      "up` brings them back by then; another (a deployment's, a script's) fails at its next call to "
                      "a stopped server; one that failed is marked Crashed by the next `up`[/]",
                      soft_wrap=True)
    # which stack: a `down` in a shell without the PAPERLINE_STATE_DIR of the stack meant stopped
    # another one (the default directory's), and "stopped: s3, prefect, mlflow" read as this one's (a trial)
    console.print(f"stopped the stack in {settings.state_dir}: {', '.join(stopped)}" if stopped
                  else f"nothing to stop in {settings.state_dir}", soft_wrap=True, highlight=False)
    if dead:  # a killed server was passed over in silence (a trial)
        console.print(f"{', '.join(dead)}: had already stopped without `paperline down` (killed or crashed: the end "
                      f"of {', '.join(str(settings.state_dir / 'logs' / f'{n}.log') for n in dead)} may say why)",
                      soft_wrap=True, highlight=False)
    serving = serve_lock_holder(settings.state_dir)
    if serving is not None and stopped:  # it went on silently (one websocket warning in its log: a trial)
        console.print(f"`paperline serve` (pid {serving}) keeps running without its stack: it serves again after the "
                      "next `paperline up` (Ctrl-C it to stop serving)", soft_wrap=True, highlight=False)
    for pid in workers if stopped else []:  # it went on silently too (a trial)
        console.print(f"`paperline worker` (pid {pid}) keeps running without its stack: it takes runs again after the "
                      f"next `paperline up` (Ctrl-C or `kill {pid}` stops it)", soft_wrap=True, highlight=False)


@app.command(cls=_Command)
@_friendly
def status() -> None:
    """Show each service with its URL and health; exit 1 when one is not healthy (so that
    `paperline status || paperline up` works in scripts)."""
    from rich.markup import escape

    from paperline.infra.cluster import describe_cluster, require_scheduler
    from paperline.infra.errors import ServiceError
    from paperline.infra.flow_runs import deployment_status
    from paperline.infra.stack import load_stack_info, stack_lock_holder, stack_status, state_problem

    settings = _settings()
    services = stack_status(settings)
    _print_services(services)
    for s in services:
        if s.detail and (s.healthy or not s.managed):  # (a configured endpoint's: a local server left running)
            console.print(f"{s.name}: {s.detail}", highlight=False, soft_wrap=True)
    dask_down, notes = None, []
    try:  # a configured scheduler is connected to, as `run` does (a dead address was reported as fine: a trial)
        workers = require_scheduler(settings, notes=notes)
    except ServiceError as exc:
        workers, dask_down = None, str(exc)
    shown = f" ({workers} worker(s) now)" if workers is not None else ""
    console.print(f"Dask: {describe_cluster(settings)}{shown}" if dask_down is None else
                  f"[red]Dask: {escape(dask_down)}[/]", highlight=False, soft_wrap=True)
    for line in notes:  # (not a failure: the runs work, slower)
        console.print(line, style="yellow", soft_wrap=True, highlight=False, markup=False)
    prefect = next((s for s in services if s.name == "prefect"), None)
    try:
        info = load_stack_info(settings) if prefect is not None and prefect.healthy else None
    except ServiceError:  # (a damaged S3 key pair file: its row says so, and the lines below)
        info = None
    if info is not None:  # who executes the deployments' runs: nothing said so, and runs waited Scheduled
        for line in deployment_status(info.prefect_api_url, info.prefect_login, settings.state_dir):
            console.print(line, highlight=False, soft_wrap=True)
    console.print(f"state directory: {settings.state_dir}")
    problem = state_problem(settings)
    if problem:  # its servers may be running unrecorded: "not running" alone sent users to `up`, which failed
        console.print(f"[yellow]{problem}[/]", highlight=False, soft_wrap=True)
    busy = stack_lock_holder(settings)
    if busy is not None:  # during an `up` it said "not running: ... (`paperline up` starts the local stack)" (a trial)
        console.print(f"another paperline command{busy} is starting, checking or stopping this stack now: the rows "
                      "above may change as it does", style="yellow", highlight=False, soft_wrap=True, markup=False)
    for line in _down_lines(services, unrecorded=bool(problem) or busy is not None):
        console.print(line, highlight=False, soft_wrap=True)
    if problem or dask_down or any(not s.healthy for s in services):
        raise typer.Exit(1)


def _down_lines(services, unrecorded: bool = False) -> list[str]:
    """What is wrong with the services that are not healthy: a local one is started by `paperline
    up`; a configured endpoint is not (`up` starts nothing for it), so its line says why it failed.
    ``unrecorded``: the stack's state could not be read, so the local ones are not known to be down."""
    from paperline.infra.errors import redact_url

    local = [s.name for s in services if not s.healthy and s.managed and not s.problem]
    lines = [f"not running: {', '.join(local)} (`paperline up` starts the local stack)"] if local and not unrecorded \
        else []
    lines += [f"{s.name}: {s.problem}" for s in services if not s.healthy and s.managed and s.problem]
    # (a 401 is no unreachable server: a trial read "not reachable" for a refused login)
    return lines + [f"{'refused' if 'not authorized' in (s.problem or '') else 'not reachable'}: {s.name} at "
                    f"{redact_url(s.url)} (configured endpoint): {s.problem}"
                    for s in services if not s.healthy and not s.managed]


def _print_services(services) -> None:
    from paperline.infra.errors import redact_url

    table = Table("service", "url", "managed", "pid", "healthy", "log")
    table.columns[1].no_wrap = True
    for s in services:
        healthy = {True: "[green]yes[/]", False: "[red]no[/]", None: "?"}[s.healthy]
        table.add_row(s.name, redact_url(s.url), "local" if s.managed else "external", str(s.pid or "-"), healthy,
                      s.log_path or "-")
    console.print(table)


@app.command(cls=_Command)
@_friendly
def env() -> None:
    """Print shell `export` lines that point Prefect's and MLflow's own CLIs at the stack:
    `eval "$(paperline env)"`, then e.g. `prefect deploy --all`, or `prefect deployment run
    gemm/local` while `paperline serve` runs; a flow a script in that shell calls runs on the stack and
    caches its task results in its S3, as with `paperline run`. Without them those CLIs use their own
    defaults (Prefect starts an empty temporary server). Dask's loggers are set to WARNING, as
    `paperline run` sets them. No credentials are printed. Fails when the stack is not running."""
    import shlex

    from paperline.infra.errors import PaperlineError, ServiceError
    from paperline.infra.stack import LOGIN_FILES, load_stack_info, stack_status

    settings = _settings()
    info = load_stack_info(settings)
    down = [s for s in stack_status(settings) if not s.healthy]
    if info is None and all(s.managed for s in down):
        raise ServiceError("stack", "not running; start it with `paperline up`")
    if down:  # a configured endpoint that fails is said why, not sent to `paperline up`
        raise PaperlineError("; ".join(_down_lines(down)))
    # plain print: rich would wrap long URLs, and `eval` needs the lines as they are; credentials in
    # a URL are not printed (they were, for Prefect's): each client reads its own variables for them
    _export("PREFECT_API_URL", info.prefect_api_url, "PAPERLINE_PREFECT_API_URL", "PREFECT_API_AUTH_STRING (user:password)")
    if info.prefect_login:  # the local server's login, read from its file by the shell, not printed
        print(f'export PREFECT_API_AUTH_STRING="$(cat {shlex.quote(str(settings.state_dir / LOGIN_FILES["prefect"]))})"')
    # a flow called from a script in this shell caches its task results in the stack's S3, as `paperline run`
    print("export PREFECT_RESULTS_PERSIST_BY_DEFAULT=true")
    print(f"export PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK={shlex.quote(info.result_storage_block)}")
    # and its local Dask cluster's loggers at WARNING, as `run` and `connect()` set them (55 lines of
    # INFO otherwise: a trial)
    # (a user's own level kept; an empty one is unset, as for paperline's settings: Dask raised KeyError: '')
    print(f"export DASK_LOGGING__DISTRIBUTED={shlex.quote(os.environ.get('DASK_LOGGING__DISTRIBUTED') or 'warning')}")
    _export("MLFLOW_TRACKING_URI", info.mlflow_tracking_uri, "PAPERLINE_MLFLOW_TRACKING_URI",
            "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN)")
    if info.mlflow_login:  # likewise: user name before the colon, password after it
        path = shlex.quote(str(settings.state_dir / LOGIN_FILES["mlflow"]))
        print(f'export MLFLOW_TRACKING_USERNAME="$(cut -d: -f1 {path})" MLFLOW_TRACKING_PASSWORD="$(cut -d: -f2- {path})"')
    # where the data and the work go, as comments (nothing exported: AWS's and Dask's own tools in
    # this shell keep their settings); `env` said neither (an infra trial)
    from paperline.infra.cluster import describe_cluster
    from paperline.infra.errors import redact_url

    endpoint = redact_url(info.s3_endpoint_url) if info.s3_endpoint_url else "AWS's default endpoint"
    print(f"# S3: {endpoint}, data bucket {info.data_bucket} (`paperline upload`, s3:// operands and outputs)")
    try:
        print(f"# Dask: {describe_cluster(settings)}")
    except PaperlineError as exc:  # device=cuda without a usable GPU: runs are refused, and say why
        print(f"# Dask: {exc}")


def _export(variable: str, url: str, setting: str, instead: str) -> None:
    """Print ``export variable=url`` without the URL's user info; where it had some, a comment
    line first naming the variables to export ``instead`` (the credentials in ``setting`` are not
    printed)."""
    import shlex
    from urllib.parse import urlsplit, urlunsplit

    from paperline.infra.errors import redact_url

    shown = redact_url(url)
    if shown != url:
        print(f"# {setting} carries credentials (not printed): export {instead}")
        parts = urlsplit(shown)
        shown = urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1]))
    print(f"export {variable}={shlex.quote(shown)}")


@app.command(cls=_Command)
@_friendly
def upload(path: Path = typer.Argument(..., metavar="PATH", help="Local file or directory, e.g. B.npy or raw/."),
           uri: str = typer.Argument(..., metavar="URI", help="Destination object, e.g. s3://paperline-data/B.npy, "
                                                             "or prefix (ending in /).")) -> None:
    """Upload a local file to an S3 object of the stack (an operand for `--set b=s3://...`, a
    tensor for `--set data=s3://...`, videos under a `source` prefix), with the stack's
    credentials. A URI ending in `/` keeps the file's name. A directory goes under a prefix (a URI
    ending in `/`), its files' relative paths kept (symbolic links are not followed). Each object
    appears only when complete."""
    import os

    from paperline.infra.errors import InputError, first_few
    from paperline.infra.storage import ObjectStore, split_uri
    from paperline.kernels.video.sources import is_utf8 as utf8
    from paperline.kernels.video.sources import shown_name

    if not utf8(uri):
        raise InputError("uri", shown_name(uri), "not valid UTF-8: S3 keys are UTF-8")
    if not path.exists():  # (a link loop was "no such file or directory": a trial)
        from paperline.kernels.video.probe import missing_detail

        raise InputError("path", shown_name(str(path)), missing_detail(path) if path.is_symlink()
                         else "no such file or directory")
    if not path.is_file() and not path.is_dir():
        raise InputError("path", shown_name(str(path)), "not a file or directory")
    if not uri.startswith("s3://") or not split_uri(uri)[0] or "//" in uri[len("s3://"):]:
        raise InputError("uri", uri, "expected s3://bucket/key (or s3://bucket/prefix/ to keep the file's name)")
    prefix = uri.endswith("/") or "/" not in uri[len("s3://"):]
    if path.is_dir():
        if not prefix:
            raise InputError("uri", uri, f"{path} is a directory: give a prefix ending in / (its files go under it)")
        walked = []  # every entry but directories, and the symbolic links to directories (not walked)
        for root, dirs, names in os.walk(path):
            walked += [Path(root, name) for name in names] + [Path(root, d) for d in dirs if Path(root, d).is_symlink()]
        files = sorted(f for f in walked if f.is_file() and not f.is_symlink())
        if not files:
            links = any(f.is_symlink() for f in walked)
            raise InputError("path", str(path), "a directory with no files" + (" (symbolic links are not followed)"
                                                                                if links else ""))
        targets = [(f, uri.rstrip("/") + "/" + f.relative_to(path).as_posix()) for f in files]
        # a name that is not UTF-8 cannot be an S3 key: it failed the whole upload with a
        # UnicodeEncodeError naming no file (a trial); the others go up, as the curation skips it
        unnamed = sorted(shown_name(f.relative_to(path).as_posix()) for f, t in targets if not utf8(t))
        targets = [(f, t) for f, t in targets if utf8(t)]
        if unnamed:
            console.print(f"skipping {len(unnamed)} file(s) whose names are not valid UTF-8 (S3 keys are UTF-8; "
                          f"rename them to upload them): {first_few(unnamed, 5)}", highlight=False, soft_wrap=True)
            if not targets:
                raise InputError("path", shown_name(str(path)), "no file with a UTF-8 name to upload (S3 keys are "
                                                                "UTF-8): rename the files")
        links = sorted(shown_name(f.relative_to(path).as_posix()) for f in walked if f.is_symlink())
        # a FIFO, socket or device: not a file to upload, and it was skipped unsaid (a trial)
        special = sorted(shown_name(f.relative_to(path).as_posix()) for f in walked
                         if not f.is_symlink() and not f.is_file() and not f.is_dir())
        for names, what in ((links, "symbolic link(s) (not followed)"),
                            (special, "special file(s) (a FIFO, socket or device: not uploaded)")):
            if names:  # said, not skipped silently (a trial)
                console.print(f"skipping {len(names)} {what}: {first_few(names, 5)}", highlight=False, soft_wrap=True)
    else:
        targets = [(path, uri.rstrip("/") + "/" + path.name if prefix else uri)]
        if not utf8(targets[0][1]):
            raise InputError("path", shown_name(str(path)), "its name is not valid UTF-8, "
                                                            "so it cannot be an S3 key: rename it, or give the "
                                                            "whole key in URI")
    for _, target in targets:  # S3's own refusal was a raw S3UploadFailedError (a trial)
        key = split_uri(target)[1]
        if {".", ".."} & set(key.split("/")):
            raise InputError("uri", target, "a key with . or .. segments (S3 keeps them as they are; most clients "
                                            "and the console cannot reach such objects)")
        if len(key.encode()) > 1024:
            raise InputError("uri", target[:80] + "...", f"a key of {len(key.encode())} bytes: S3 takes at most 1024")
    info = _ensure_stack()
    from paperline.kernels.video.sources import in_staging, staging_prefix  # (light: not the flow's ~2 s of imports)

    staging = staging_prefix(info.data_bucket)  # (runs refuse it as a source or output; upload took it: a trial)
    if in_staging(uri, staging) or any(in_staging(t, staging) for _, t in targets):
        raise InputError("uri", uri, f"inside {staging}/, where the video curation's tasks stage the clips they cut "
                                     "(content-addressed, shared by every dataset): upload videos elsewhere, e.g. "
                                     f"s3://{info.data_bucket}/incoming/")
    store = ObjectStore.from_stack(info)
    store.require_bucket("uri", uri)
    for source, target in targets:
        store.upload_file_to(source, target)
        console.print(f"uploaded {shown_name(source)} ({source.stat().st_size:,} bytes) to {target}", highlight=False,
                      soft_wrap=True)


@app.command(cls=_Command)
@_friendly
def datasets() -> None:
    """List the bundled real datasets (tensors, and the images compressed-training trains on)
    and the search problems of the nas pipeline."""
    from paperline.kernels.tensor.datasets import dataset_info, dataset_names
    from paperline.kernels.train.data import dataset_rows

    table = Table("name", "shape (time last)", "modes", "source", "description")
    for name in dataset_names():
        i = dataset_info(name)
        table.add_row(i.name, " x ".join(map(str, i.shape)), ", ".join(i.mode_names), i.source,
                      f"{i.description}; {i.transform}")
    console.print(table)
    from paperline.kernels.search.problems import make_problem, problem_names

    table = Table("problem (nas)", "search space", "objectives (max/min)", title="search problems")
    for name in problem_names():
        p = make_problem(name)
        space = (f"{p.space.dim} categorical variables, {p.space.size():,.0f} points" if p.space.is_categorical
                 else f"box, {p.space.dim} dimensions")
        table.add_row(name, space, ", ".join(f"{o.name} ({'max' if o.maximize else 'min'})" for o in p.objectives))
    console.print(table)
    table = Table("dataset (compressed-training)", "train / test images (28x28)", "classes", "source", "installed",
                  title="image classification")
    for row in dataset_rows():
        table.add_row(row["name"], row["split"], row["classes"], row["source"], row["installed"])
    console.print(table)


@app.command(cls=_Command)
@_friendly
def params(pipeline: Optional[str] = typer.Argument(None, metavar="PIPELINE", help=PIPELINE_HELP),
           preset: Optional[list[str]] = typer.Option(None, "--preset", metavar="NAME",
                                                      help="Show this preset's values (default: demo).")) -> None:
    """List a pipeline's parameters (what `run --set key=value` takes): type, the preset's value,
    description; and the pipeline's own option tables (nas: each optimizer's options). Without
    PIPELINE: every pipeline, built in or added by an installed package, with its schedule."""
    from paperline.flows.pipelines import get_pipeline
    from paperline.infra.errors import InputError

    if pipeline is None:
        if preset:
            raise InputError("--preset", preset[0], "name a pipeline too: paperline params PIPELINE --preset NAME")
        _print_pipelines()
        return
    _print_parameters(get_pipeline(pipeline), _one_preset(preset))


def _print_pipelines() -> None:
    """The table of every pipeline: name, where it comes from, its deployments' schedule, what it
    does. A package's pipeline that cannot be loaded is a row saying why (the others still show)."""
    from rich.text import Text

    from paperline.flows.pipelines import get_pipeline, package_of_pipeline, pipeline_names

    table = Table("pipeline", "from", "schedule (UTC)", "presets", "description", title="pipelines")
    for name in pipeline_names():
        origin = package_of_pipeline(name)
        try:
            spec = get_pipeline(name)
        except PaperlineError as exc:
            table.add_row(Text(name), Text(origin), "", "", Text(f"cannot be loaded: {exc}", style="red"))
            continue
        # as text: a package's description "uses [/tmp] scratch" was a MarkupError (a review)
        table.add_row(Text(name), Text(origin), Text(spec.cron or "none"), Text(", ".join(sorted(spec.presets))),
                      Text(spec.description))
    console.print(table)
    console.print("`paperline params PIPELINE` lists a pipeline's parameters; `paperline run PIPELINE` runs it.",
                  highlight=False, markup=False)


def _print_parameters(spec: Any, preset: str) -> None:
    """The table of ``spec``'s parameters with ``preset``'s values, and the pipeline's own option
    tables (``params``, and ``run PIPELINE --help``)."""
    import importlib

    from rich.text import Text

    from paperline.flows.pipelines import build_parameters

    values = build_parameters(spec, preset, []).model_dump()
    table = Table("parameter", "type", f"--preset {preset}", "description",
                  title=f"{spec.name}: parameters (presets: {', '.join(sorted(spec.presets))})")
    for name, field in spec.parameters.model_fields.items():
        # as text, not rich markup: "list[str]" showed as "list" ("[str]" read as a style tag), and a
        # value or description with brackets lost them too
        table.add_row(name, Text(_shown_type(field.annotation)), Text(json.dumps(values.get(name), default=str)),
                      Text(field.description or ""))
    console.print(table)
    extra = getattr(importlib.import_module(spec.flow.__module__), "options_table", None)
    if extra is not None:
        title, columns, rows = extra()
        more = Table(*columns, title=title)
        for row in rows:
            more.add_row(*row)
        console.print(more)


def _shown_type(annotation: Any) -> str:
    """A parameter's type as `params` shows it: ``list[int] | None``, ``Literal['N', 'T']``; a
    constrained item type (``list[Annotated[int, Field(ge=1)]]``, a package's pipeline) as its
    type alone (``list[int]``), not pydantic's FieldInfo text; a ``Literal``'s values as their
    reprs (a dotted text value lost its head, and a mixed one its quotes, in the text form)."""
    import typing

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _shown_type(args[0])
    if origin is typing.Literal:
        return f"Literal[{', '.join(repr(a) for a in args)}]"
    if origin in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else _shown_type(a) for a in args)
    if origin is not None and args:
        return f"{getattr(origin, '__name__', origin)}[{', '.join('...' if a is ... else _shown_type(a) for a in args)}]"
    return annotation.__name__ if isinstance(annotation, type) else re.sub(r"[\w.]+\.(\w+)", r"\1", str(annotation))


class _RunCommand(_Command):
    """``run``'s help: given a pipeline (``paperline run gemm --help``), also that pipeline's
    parameters, as ``paperline params`` lists them (the help was the same for every pipeline, and
    a user asks it of the pipeline at hand: a trial)."""

    VALUED = ("--preset", "--set", "--summary-json")  # the options that take a value

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        # --help is eager: it prints before the arguments are bound, so they are read here
        words, presets, i = [], [], 0
        while i < len(args):
            arg = args[i]
            if arg in self.VALUED:
                if arg == "--preset" and i + 1 < len(args):
                    presets.append(args[i + 1])
                i += 2
                continue
            if arg.startswith("--preset="):
                presets.append(arg.split("=", 1)[1])
            elif arg == "--":
                words.extend(args[i + 1:])
                break
            elif not arg.startswith("-"):
                words.append(arg)
            i += 1
        ctx.meta["paperline.run.pipeline"] = words[0] if words else None
        ctx.meta["paperline.run.extra"] = words[1:]
        ctx.meta["paperline.run.presets"] = presets
        return super().parse_args(ctx, args)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        super().format_help(ctx, formatter)
        name = ctx.meta.get("paperline.run.pipeline")
        if name is None:
            return
        from paperline.flows.pipelines import get_pipeline

        try:  # what `run` itself refuses is refused here too (two presets, a second pipeline)
            if ctx.meta["paperline.run.extra"]:
                raise PaperlineError(f"one pipeline at a time: {name!r} and {', '.join(map(repr, ctx.meta['paperline.run.extra']))} given")
            _print_parameters(get_pipeline(name), _one_preset(ctx.meta["paperline.run.presets"]))
        except (PaperlineError, KernelInputError) as exc:  # an unknown pipeline or preset
            err_console.print(f"error: {exc}", markup=False, highlight=False)
            ctx.exit(2)


@app.command(cls=_RunCommand)
@_friendly
def run(pipeline: Optional[str] = typer.Argument(None, metavar="PIPELINE", help=PIPELINE_HELP),
        preset: Optional[list[str]] = typer.Option(None, "--preset", metavar="NAME",
                                                   help="Parameter preset (default: demo, which every pipeline has; "
                                                        "`paperline params PIPELINE` lists its others: default, and full where it has one)."),
        set_: Optional[list[str]] = typer.Option(None, "--set", metavar="KEY=VALUE", help="Override a parameter: key=value (repeatable)."),
        summary_json: Optional[Path] = typer.Option(None, "--summary-json", metavar="FILE",
                                                    help="Write the parameters (key 'parameters', as run) and the "
                                                         "summary: metrics, run ids, artifact URIs, as JSON "
                                                         "(missing directories are created)."),
        ) -> None:
    """Run a pipeline on the stack (started if needed) and print its results and URLs.

    `paperline run PIPELINE --help` (or `paperline params PIPELINE`) lists the parameters --set takes."""
    from paperline.flows.pipelines import build_parameters, get_pipeline, pipeline_names

    pipeline = _named(pipeline, "run")
    preset = _one_preset(preset)
    if summary_json is not None:
        _check_summary_path(summary_json)
    with _said_if_interrupted(), _startup_gc_paused(), _early_cluster(pipeline in pipeline_names()) as early:
        spec = get_pipeline(pipeline)
        params = build_parameters(spec, preset, set_ or [])
        _run_one(spec, params, summary_json, early)


def _startup_gc_paused() -> contextlib.AbstractContextManager[Any]:
    """The cyclic collector off while a run starts, until :func:`_run_one` freezes the start-up
    heap (``infra/heap.py``: 1.0 s of a cached run's CPU was collections walking it); in the
    console script's own process only, and before its first freeze."""
    from paperline.infra import heap

    if _state.get("own_process") and not heap.frozen():
        return heap.paused_for_startup()
    return contextlib.nullcontext()


@contextlib.contextmanager
def _said_if_interrupted() -> Iterator[None]:
    """A Ctrl-C before the flow run started (the cluster starting, the stack checked) ended the
    command with exit status 130 and not a word (a trial); :func:`_run_one` says what the same
    command does next once the run has started."""
    from paperline.infra import interrupts
    from paperline.infra.watch import ServersDied

    _state["interrupt_said"] = False  # (a command of its own: in-process tests run several)
    _state["reported"] = False
    try:
        try:
            yield
        except Exception as exc:
            if not interrupts.interrupts_received() or isinstance(exc, ServersDied):  # (the watch's own interrupt)
                raise
            # a library turned the Ctrl-C into its own error (pydantic's "PydanticSerializationError:
            # Error calling function `_ser_model`: KeyboardInterrupt", exit 1: a stress test)
            raise KeyboardInterrupt from exc
    except KeyboardInterrupt:
        if _state.get("reported"):  # (its Dask cluster closing after the results were printed)
            _say_interrupted("interrupted as the run's Dask cluster closed: the run is done (the results above)")
        _say_interrupted("interrupted before the flow run started: nothing ran (the same command starts it)")
        raise


def _say_interrupted(line: str) -> None:
    """Say ``line`` of a Ctrl-C once (the innermost handler that knows most says it)."""
    if not _state.get("interrupt_said"):
        _say(line)
        _state["interrupt_said"] = True


def _named(pipeline: str | None, command: str) -> str:
    """``pipeline``, or (none given) an error listing the pipelines: Typer's usage box named
    neither them nor where to look."""
    if pipeline is None:
        from paperline.flows.pipelines import pipeline_names

        raise PaperlineError(f"name a pipeline: paperline {command} PIPELINE, one of {', '.join(pipeline_names())}")
    return pipeline


def _one_preset(given: list[str] | None) -> str:
    """The ``--preset`` given (``demo`` when none); given twice it is refused, as a repeated
    ``--set`` is (the last one silently won)."""
    from paperline.infra.errors import InputError

    if not given:
        return "demo"
    if len(given) > 1:
        times = "twice" if len(given) == 2 else f"{len(given)} times"  # as a repeated --set says it
        raise InputError("--preset", given[-1], f"given {times} ({', '.join(map(repr, given))}); "
                                                "give it once")
    return given[0]


def _check_summary_path(path: Path) -> None:
    """``--summary-json`` is written after the run: a path it cannot be written to is refused
    before anything starts (a directory failed with IsADirectoryError after the whole run).
    Missing parent directories are created then. Raises InputError."""
    from paperline.infra.errors import InputError
    from paperline.infra.storage import nearest_existing, require_outside_state_dir, require_writable_dir

    if path.is_dir():
        raise InputError("--summary-json", str(path), "is a directory; name a file, e.g. summary.json")
    require_outside_state_dir("--summary-json", str(path), path, _settings().state_dir)
    existing = nearest_existing(path.expanduser().absolute().parent)
    if not existing.is_dir():
        raise InputError("--summary-json", str(path), f"{existing} is a file, not a directory")
    require_writable_dir("--summary-json", str(path), existing)


@contextlib.contextmanager
def _early_cluster(wanted: bool = True) -> Iterator[Any]:
    """The run's local Dask cluster, started now on a background thread (``BackgroundCluster``,
    closed on leaving), with the stack's URLs its workers inherit; or None where that cannot be
    known yet (or not ``wanted``).

    Started before the pipeline's module is imported, its workers spawn and import while this
    process imports the pipeline, checks the stack and creates the flow run. Only when the run
    will use a local cluster and the local stack's servers are running: its endpoints (the
    workers' environment) are then known before the health check, which :func:`_run_one` makes.

    Yields:
        ``(cluster, (prefect_api_url, mlflow_tracking_uri))`` or None.
    """
    from paperline.infra import interrupts
    from paperline.infra.cluster import BackgroundCluster, quiet_dask_logs
    from paperline.infra.stack import activate, running_local_stack

    interrupts.install()  # a Ctrl-C landing in a finalizer or a gc callback (a scheduler runs here) was lost
    interrupts.hangup_as_interrupt()  # a closed terminal stops the run as Ctrl-C does
    settings = _settings()
    info = running_local_stack(settings) if wanted and not settings.dask_scheduler_address else None
    early = None
    if info is not None:
        quiet_dask_logs()
        activate(info)
        with contextlib.suppress(Exception):  # e.g. device=cuda without a GPU: _run_one reports it in full
            early = BackgroundCluster(settings), (info.prefect_api_url, info.mlflow_tracking_uri)
    try:
        yield early
    except KeyboardInterrupt:
        interrupts.release_leaked_import_lock()  # else the cluster's start, joined below, could wait for good
        raise
    except PaperlineError:  # ServersDied: the run watch's interrupt can land where a Ctrl-C can
        if interrupts.interrupts_received():
            interrupts.release_leaked_import_lock()
        raise
    finally:
        if early is not None:
            early[0].close()


def _say_no_workers(workers: int | None, settings: Any) -> None:
    """Warn when the configured Dask scheduler has no worker: the run's tasks wait for one,
    silently (a trial's tensor and nas runs printed nothing for minutes). Not refused: an
    adaptive cluster starts its workers when tasks come."""
    if workers == 0:  # (and the run's local paths cannot be checked: a trial's joining worker lacked them)
        err_console.print(f"[yellow]the Dask scheduler at {settings.dask_scheduler_address} has no workers now: the "
                          "run's tasks wait until one joins (`dask worker ADDRESS`, or your cluster's scaling); "
                          "whether the workers see the run's local paths is not checked[/]",
                          soft_wrap=True, highlight=False)


def _quiet_logs() -> None:
    """Keep the terminal to the result table: Dask's chatter at WARNING, the comparison with the
    best earlier run once (in the printed summary, not also as its log record), and (unless
    --debug) Prefect's console records without tracebacks (all complete in the Prefect UI)."""
    import logging

    from prefect.logging.configuration import setup_logging
    from prefect.logging.handlers import PrefectConsoleHandler

    from paperline.infra.cluster import quiet_dask_logs
    from paperline.infra.prefect_worker import queued_not_aborted
    from paperline.infra.regression import not_in_summary

    setup_logging()  # idempotent; Prefect's console handler sits on the root logger
    quiet_dask_logs()  # after Prefect's setup: it lists `distributed` among its extra loggers, at INFO
    # Prefect's console handlers only, not every handler on the root: in a process that hosts other
    # code, pytest's capture handlers (kept for the session) dropped a later test's records (CI)
    consoles = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    for handler in consoles:  # the same function objects: added once
        handler.addFilter(not_in_summary)
        handler.addFilter(_not_said_before)
        handler.addFilter(_short_event_failures)
        handler.addFilter(_no_unfinished_finish)
        handler.addFilter(queued_not_aborted)  # serve's runner (`paperline worker`'s child has its own)
        handler.addFilter(_no_gather_exit)
        handler.addFilter(_no_shutdown_connect_error)
        handler.addFilter(_stop_not_keyboard)
        handler.addFilter(_no_crash_line_for_the_watch)
        handler.addFilter(_error_said_once)
        handler.addFilter(_retries_said_once_a_minute)
        if not _state["debug"]:
            handler.addFilter(_strip_traceback)
    for handler in logging.getLogger("prefect._internal").handlers:  # its own (the events worker's records)
        handler.addFilter(_short_event_failures)
    logging.getLogger("distributed.nanny").addFilter(_no_kill_notice)
    logging.getLogger("tornado.application").addFilter(_no_sync_cancel_race)


def _no_sync_cancel_race(record: Any) -> bool:
    """Drop tornado's ``Exception in callback functools.partial(<function sync.<locals>.cancel ...>)``
    with its ``NameError`` (``cannot access free variable 'future'``): Dask's ``sync()`` schedules
    its ``cancel`` on a Ctrl-C that comes before its coroutine made the future (distributed/utils.py),
    and the traceback reached a trial's terminal after the run's own "interrupted" line. Harmless:
    nothing was running to cancel. Any other callback error is kept."""
    exc = record.exc_info[1] if record.exc_info else None
    if not isinstance(exc, NameError) or "'future'" not in str(exc):
        return True
    try:
        return "sync.<locals>.cancel" not in record.getMessage()
    except (TypeError, ValueError):
        return True


def _error_said_once(record: Any) -> bool:
    """Drop Prefect's "Encountered exception during execution: InputError(...)" of an error
    paperline raised on purpose (marked by :class:`paperline.infra.errors.ExpectedErrorOneLine`):
    the run's "Finished in state Failed(...)" and this command's ``error:`` line say it (a trial
    read one refusal three times), nor its task run's "Task run failed with exception: ..." (a
    diverged training said its error five times: a trial). The Prefect UI's log keeps them."""
    return not (getattr(record, EXPECTED_ERROR, False)
                and record.getMessage().startswith(("Encountered exception during execution",
                                                    "Task run failed with exception")))


_RETRY_SAID = {"at": None}  # when one of urllib3's "Retrying" lines was last let through (time.monotonic)
RETRY_QUIET_S = 60.0


def _retries_said_once_a_minute(record: Any) -> bool:
    """Let one of urllib3's "Retrying (Retry(total=...)) after connection broken by ..." warnings
    through a minute: a configured MLflow server that died under a run printed about 28 of them
    before the run's one-line error (a trial on infrastructure of its own)."""
    import time

    if record.name != "urllib3.connectionpool" or not str(record.msg).startswith("Retrying ("):
        return True
    now, last = time.monotonic(), _RETRY_SAID["at"]
    if last is not None and now - last < RETRY_QUIET_S:
        return False
    _RETRY_SAID["at"] = now
    return True


def _no_crash_line_for_the_watch(record: Any) -> bool:
    """Drop Prefect's ``Crash detected! Execution was aborted by an interrupt signal.`` and its
    ``Finished in state Crashed('Execution was aborted by an interrupt signal.')`` once the run
    watch has stopped the run (its interrupt): nobody pressed Ctrl-C, and the run's own error says
    which servers went (a trial read the line as a wrong claim). Likewise after a user's Ctrl-C
    (or SIGTERM, SIGHUP): the command's own ``interrupted: ...`` line says what happened and what
    the same command does next, and three ERROR lines of Prefect's came before it (a later
    trial). The Prefect UI's log keeps them.

    SIGTERM reaches the run while Prefect's engine has its own handler in place: it logs "aborted
    by a termination signal" (the only source of that words here) before passing the signal on to
    `paperline run`'s handler, which counts it only then: those lines are dropped whatever the count
    (a trial: one red ERROR line on SIGTERM, none on Ctrl-C), where that handler is in place."""
    from paperline.infra.interrupts import interrupts_received, sigterm_is_interrupt

    if not record.name.startswith("prefect"):
        return True
    text = record.getMessage()
    if text.startswith(("Crash detected! Execution was aborted by a termination signal",
                        "Finished in state Crashed('Execution was aborted by a termination signal")):
        return not sigterm_is_interrupt()  # (else nothing else would say why the run stopped: a review)
    if not (_state.get("watch_stopped") or interrupts_received()):
        return True
    return not (text.startswith("Crash detected! Execution was aborted by an interrupt signal")
                or text.startswith("Finished in state Crashed('Execution was aborted by an interrupt signal"))


def _no_gather_exit(record: Any) -> bool:
    """Drop asyncio's ``Task exception was never retrieved ... Client._gather.<locals>.wait() ...
    exception=AllExit()``: Dask's client ends its gather's waiters so when a run's gather is
    cancelled (Ctrl-C), and two such ERROR records came before the "interrupted" line (a trial)."""
    if record.name != "asyncio":
        return True
    text = record.getMessage()
    return not ("Task exception was never retrieved" in text and "exception=AllExit()" in text)


def _no_shutdown_connect_error(record: Any) -> bool:
    """Drop asyncio's ``unhandled exception during asyncio.run() shutdown`` for Prefect's runner
    ending on a connection error: `paperline serve` stopped while its Prefect server is away (the
    runner's last call, pausing its deployments, fails), and the lines after it say what could not
    be done (a trial: an ERROR and a traceback before them)."""
    if record.name != "asyncio" or not record.getMessage().startswith("unhandled exception during asyncio.run"):
        return True
    import httpx  # noqa: PLC0415

    return not (record.exc_info and isinstance(record.exc_info[1], httpx.TransportError))


def _stop_not_keyboard(record: Any) -> bool:
    """Say Prefect's ``Received KeyboardInterrupt, shutting down...`` (a serve stopping) as a stop:
    `paperline serve` stops on SIGTERM as on Ctrl-C, and a supervisor's ``kill`` read as a key
    pressed (a trial)."""
    if record.name == "prefect.flows" and record.getMessage() == "Received KeyboardInterrupt, shutting down...":
        record.msg, record.args = "Stopping (Ctrl-C or SIGTERM): shutting down...", ()
    return True


def _no_kill_notice(record: Any) -> bool:
    """Drop Dask's ``Worker process still alive after 4.0 seconds, killing``: a worker busy in a
    task (a training rank in a collective) when the run's cluster closes, as after Ctrl-C, is
    killed; the line, several on an interrupt, told the user nothing to do (a trial)."""
    return not str(record.msg).startswith("Worker process still alive after")


_short_event_failures = short_event_failure  # (the workers' records get it from their preload too)


def _strip_traceback(record: Any) -> bool:
    record.exc_info = None
    record.exc_text = None
    return True


# what the same `paperline run` does after an interrupted one (printed on Ctrl-C)
AGAIN = {
    "nas": "the same command resumes the campaign from its last checkpoint (written as it starts and after each "
           "batch; the evaluations finished since are cached)",
    "compressed-training": "the same command resumes training from the last epoch every rank checkpointed",
    "video-curation": "the same command reuses the videos already curated (cached) and the shards already uploaded, "
                      "or, if the dataset was committed before the stop, finds it and rewrites nothing",
    "tensor-factorization": "the same command reuses the loads, splits and fits that finished (cached)",
    "gemm": "the same command runs the multiply again (staged random operands are reused)",
}


def _again(pipeline: str, params: Any) -> str:
    """What the same `paperline run` does after an interrupted one."""
    if getattr(params, "resume", True) is False:  # nas with resume=false starts over
        return ("the same command starts the campaign over (its evaluations come from the task cache); without "
                "resume=false it resumes from the last checkpoint")
    return AGAIN.get(pipeline, "the same command runs it again")


def _run_one(spec, params, summary_json: Path | None, early=None) -> dict[str, Any]:
    """Run ``spec``'s flow on ``params`` and print its summary.

    Args:
        early: :func:`_early_cluster`'s result: the flow's runner takes its cluster over if the
            stack's URLs are still those its workers inherited (else the flow starts its own);
            the caller closes it too, in case the run never started.
    """
    from paperline.infra import heap, interrupts
    from paperline.infra.cluster import describe_cluster, require_scheduler, require_shared_paths, task_runner

    _said_before.clear()  # (in-process tests run several)
    if hasattr(params, "validate_inputs"):
        params.validate_inputs()
    _say_data_warnings(params)  # before the stack and the cluster start (tens of seconds, or minutes)
    _quiet_logs()
    settings = _settings()
    notes: list[str] = []  # a configured cluster's workers' set-up: BLAS threads, malloc trimming
    workers = require_scheduler(settings, notes=notes)  # a configured scheduler's workers now (None: a local cluster)
    _say_no_workers(workers, settings)  # before starting anything
    for line in notes:
        err_console.print(line, style="yellow", soft_wrap=True, highlight=False, markup=False)
    if workers and hasattr(params, "worker_paths"):  # before the stack and the flow run (each refusal in the
        require_shared_paths(settings, params.worker_paths(settings.state_dir))  # flow was a Failed run: a trial)
    if hasattr(params, "validate_workers"):  # compressed-training's ranks (was refused in the run, after
        params.validate_workers(workers)  # its flow and MLflow runs were made: a trial)
    info = _ensure_stack()
    if hasattr(params, "validate_on_stack"):  # checks that need the stack's services (nas: its checkpoints)
        from paperline.infra.storage import ObjectStore

        params.validate_on_stack(info, ObjectStore.from_stack(info))
        _say_data_warnings(params)  # an s3:// object's, read just now
    console.print(f"[bold]{spec.name}[/] on {describe_cluster(settings)}")
    started = None
    if early is not None:
        if early[1] == (info.prefect_api_url, info.mlflow_tracking_uri):
            started = early[0]
        else:  # the stack came back on other ports: its workers would talk to the old ones
            early[0].close()
    flow = spec.flow.with_options(task_runner=task_runner(settings, started=started))
    done: dict[str, Any] = {}  # the flow's return value, kept in case Prefect cannot take its end
    flow.fn = _keeping_result(flow.fn, done)
    if _state.get("own_process"):
        import mlflow.tracking  # noqa: F401, PLC0415 - every run tracks: imported before the freeze, not walked after it

        heap.freeze_startup()  # what start-up loaded stays: later collections need not walk it
    interrupts.raise_if_interrupted()  # a Ctrl-C that a library swallowed while this started (a CI run)
    watch = _server_watch(settings, info)
    _state["watch_stopped"] = False  # (in-process tests run several)
    try:
        try:
            with watch, console.status(f"running {spec.name} (progress in the Prefect UI)..."):
                summary = flow(params)
        except Exception as exc:
            if interrupts.interrupts_received():  # the error a Ctrl-C was turned into (see raise_if_interrupted)
                raise KeyboardInterrupt from exc
            raise
    except KeyboardInterrupt:  # Prefect's "Crash detected!" line alone said nothing of what a re-run does
        if watch.dead:  # the interrupt was the watch's
            raise _servers_died(watch.dead, spec, params, done, summary_json, "the run was stopped") from None
        if dead := watch.gone_now():  # a Ctrl-C as servers died: a re-run needs them back first
            _say_interrupted(f"interrupted: {_servers_died(dead, spec, params, {}, None, 'the run was stopped')}")
        if "summary" in done:  # its work done and tracked, the Ctrl-C came as Prefect ended the flow run
            _finished_when_interrupted(spec, params, done["summary"], summary_json)
        _say_interrupted(f"interrupted: {_again(spec.name, params)}")
        raise
    except Exception as exc:
        if dead := watch.gone_now():  # it failed on its own before the watch's grace ran out
            first = (str(exc).splitlines() or [""])[0]
            said = getattr(exc, "service", None) in dead  # a dead server's own error: the line names it already
            raise _servers_died(dead, spec, params, done, summary_json, "the run failed" + (
                "" if said else f" ({type(exc).__name__}: {first[:200]})")) from exc
        gone = _prefect_gone(exc, info, finished="summary" in done)
        if gone is None:
            raise
        _state["prefect_gone"] = True  # Prefect's exit hooks would retry sending logs and events to it
        if "summary" in done:  # the work was done and tracked: its results were not printed (a trial)
            _report(spec, params, done["summary"], summary_json)
        raise gone from exc
    finally:
        _said_before.clear()  # (its filter stays on the console handlers: a later record is not this run's)
    try:
        if done.get("flow_run_id") and isinstance(summary, dict):
            retried = _retried_tasks(done["flow_run_id"])
            if retried:  # the results are the retries': after a lost worker nothing said a task had failed (a trial)
                summary = {**summary, "lines": [*summary.get("lines", []), *retried]}
    except KeyboardInterrupt:
        _finished_when_interrupted(spec, params, summary, summary_json)
        raise
    _report(spec, params, summary, summary_json)
    return summary


def _as_summary(name: str, summary: Any) -> dict[str, Any]:
    """``summary`` as the dict the CLI prints: a package's flow (README, "Your own pipeline") may
    return anything, and a None or a number failed the finished run's report with a TypeError."""
    if isinstance(summary, dict):
        lines = summary.get("lines", [])
        if isinstance(lines, list) and all(isinstance(line, str) for line in lines):
            return summary
        # ("lines": "text" printed a character a line, None failed before --summary-json: a review)
        if lines is None:
            lines = []
        elif isinstance(lines, list):
            lines = [str(line) for line in lines]
        else:
            lines = [str(lines)]
        return {**summary, "lines": lines}
    shown = repr(summary)
    return {"result": summary, "lines": [f"{name}'s flow returned {shown[:200]}{'...' if len(shown) > 200 else ''}"
                                         ", not a summary dict (its table, lines and URLs: README, \"Your own "
                                         "pipeline\")"]}


def _finished_when_interrupted(spec: Any, params: Any, summary: Any, summary_json: Path | None) -> None:
    """A Ctrl-C that came once the run's work was done and tracked (as Prefect ended its flow run,
    or as its results were gathered): its results printed, and that said. It said "interrupted
    before the flow run started: nothing ran", and printed nothing, of a run Completed in Prefect
    and FINISHED in MLflow (a trial, twice)."""
    if isinstance(summary, dict):
        _report(spec, params, summary, summary_json)
    _say_interrupted("interrupted as the run finished: its work is done and tracked (the results above; the "
                     "Prefect UI shows how its flow run ended)")


_said_before: set[str] = set()  # the warnings printed before the run: its flow's log records of them are left off


def _say_data_warnings(params: Any) -> None:
    """Print the warnings the checks found about a run's data (tensor-factorization's
    ``data_warnings``: indices that are not positions, a baseline on mostly empty ones) before it
    starts, each once: they were printed only under the results, after a baseline had run for
    minutes (a fresh-user trial). The flow logs them too as it loads the data (for deployments);
    :func:`_not_said_before` keeps those records off this terminal."""
    for line in getattr(params, "data_warnings", list)():
        if line not in _said_before:
            _said_before.add(line)
            console.print(line, style="yellow", soft_wrap=True, highlight=False, markup=False)


def _not_said_before(record: Any) -> bool:
    """A logging filter: False for a record whose message the run printed before it started
    (:func:`_say_data_warnings`)."""
    return not (_said_before and record.getMessage() in _said_before)


def _server_watch(settings: Any, info: Any) -> Any:
    """A :class:`~paperline.infra.watch.ServerWatch` on the stack's managed servers (``info``)
    for one run: clients fail at once on a server that has died (not stopped by `paperline
    down`), and if it is not back within the grace the run is stopped by an interrupt to the main
    thread, which `_run_one` turns into :func:`_servers_died`'s error. Where SIGINT is not
    Python's to raise (ignored: `paperline run ... &` from a script), or the run is not on the
    main thread, nothing is interrupted: the run fails on its own, at once."""
    import signal
    import threading

    from paperline.infra.watch import ServerWatch, check_result_writes

    def stop_run(dead: dict[str, Any]) -> None:
        if interrupts_run:
            _state["watch_stopped"] = True
            signal.pthread_kill(main.ident, signal.SIGINT)

    main = threading.main_thread()
    raises = signal.getsignal(signal.SIGINT) not in (signal.SIG_IGN, signal.SIG_DFL, None)
    interrupts_run = threading.current_thread() is main and raises
    return ServerWatch(settings, stop_run, services=tuple(s.name for s in info.services if s.managed),
                       on_gone=check_result_writes)


def _servers_died(dead: dict[str, Any], spec: Any, params: Any, done: dict[str, Any], summary_json: Path | None,
                  outcome: str) -> Exception:
    """The error for a run whose stack servers ``dead`` (``{service: record}``) died under it,
    ``outcome`` saying what became of it; a run whose work was done (``done["summary"]``: Prefect
    gone as it finished) has its results printed and ``summary_json`` written first, as
    :func:`_run_one` does for Prefect gone alone. Prefect's among them, the exit skips Prefect's
    drains to it (they waited 15 s)."""
    from paperline.infra.watch import ServersDied

    if "prefect" in dead:
        _state["prefect_gone"] = True
    if "summary" in done:  # the results were not printed (a trial, with Prefect alone gone)
        _report(spec, params, done["summary"], summary_json)
        outcome = "its work is done (the results above), but what the dead servers were to record last may be missing"
    else:
        outcome += " and its end may not be recorded"
    said = []
    died = {n: r for n, r in dead.items() if not r.get("stopped")}
    stopped = [n for n in dead if n not in died]
    if died:
        names = ", ".join(f"{name} (pid {rec.get('pid')})" for name, rec in died.items())
        logs = ", ".join(str(rec["log_path"]) for rec in died.values() if rec.get("log_path"))
        said.append(f"the stack's {'server' if len(died) == 1 else 'servers'} {names} died during the run, not "
                    f"stopped by `paperline down` (killed, crashed or out of memory"
                    f"{f': the end of {logs} may say' if logs else ''})")
    if stopped:  # `down` under a run: it ended 84 s later on retries (a trial)
        said.append(f"{'and ' if died else 'the stack '}({', '.join(stopped)}) was stopped by `paperline down` "
                    "during the run")
    again = _again(spec.name, params)
    if "s3" in dead and "cached" in again:  # the task cache is in S3: a trial's nas run said its evaluations
        again += " (not those that finished with S3 down: they run again)"  # were cached as their commits failed
    return ServersDied(f"{' '.join(said)}; {outcome}; `paperline up` starts {'it' if len(dead) == 1 else 'them'} "
                       f"again, then {again}")


RETRIED_SHOWN = 5  # the most lines of retried task runs under a run's results


def _retried_tasks(flow_run_id: str) -> list[str]:
    """One line per task run of the flow run ``flow_run_id`` that ran more than once (Prefect
    retried it after a failure: a lost worker, an S3 hiccup), naming the failure from its log; []
    when none did or the Prefect server cannot say (the run itself is done)."""
    import time
    import uuid

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterTaskRunId
    from prefect.settings import get_current_settings

    lines: list[str] = []
    # task runs reach the server as events, sent in batches and recorded as they arrive: under
    # load a run's retried task runs were not there yet when read (CI): the events sent first, then
    # read until two readings agree
    with contextlib.suppress(Exception):
        from prefect.events.worker import EventsWorker

        EventsWorker.drain_all(timeout=10.0)
    try:
        with get_client(sync_client=True) as client:
            only = FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(str(flow_run_id))]))

            def read() -> list[Any]:
                runs, page = [], 200
                while True:  # (a nas campaign's flow run has hundreds of task runs)
                    got = client.read_task_runs(flow_run_filter=only, limit=page, offset=len(runs))
                    runs += got
                    if len(got) < page:
                        return runs

            settled_by = time.monotonic() + get_current_settings().logging.to_api.batch_interval + 3.0
            runs, seen = read(), None
            while time.monotonic() < settled_by:
                now = sorted((str(r.id), r.run_count, r.state_name) for r in runs)
                if now == seen:
                    break
                seen = now
                time.sleep(0.3)
                runs = read()
            retried = sorted((r for r in runs if (r.run_count or 0) > 1), key=lambda r: r.name)
            more = len(retried) - (RETRIED_SHOWN - 1) if len(retried) > RETRIED_SHOWN else 0
            retried = retried[:len(retried) - more]  # (a lost worker under a nas campaign: dozens)
            # the failure is in the task's log, sent in batches by the process that ran it: waited for
            wait_until = time.monotonic() + get_current_settings().logging.to_api.batch_interval + 3.0
            for run in retried:
                while True:
                    logs = client.read_logs(log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[run.id])))
                    why = [m.message.split(" - Retry ")[0].removeprefix("Task run failed with ")
                           .removeprefix("exception: ") for m in logs if m.message.startswith("Task run failed with ")]
                    if why or time.monotonic() > wait_until:
                        break
                    time.sleep(0.5)
                ended = "the results above are its last run's" if run.state_name == "Completed" \
                    else f"it ended {run.state_name}"
                why = [_with_dask_words(w) for w in why]
                lines.append(f"retried: {run.name} ran {run.run_count} times"
                             + (f" (a run before failed: {'; then '.join(why)})" if why else "") + f": {ended}")
            if more:
                lines.append(f"retried: {more} more task runs (the Prefect flow run's page lists them)")
    except Exception:  # noqa: BLE001 - only a report on a finished run: its results stand without it
        # ... but a Ctrl-C that a library turned into its own error here is still a Ctrl-C (it was
        # swallowed: the results printed and the command exited 0, a review)
        from paperline.infra.interrupts import raise_if_interrupted

        raise_if_interrupted()
        return lines
    return lines


# Dask's errors for a task whose worker went away, which say nothing of it themselves
# (``FutureCancelledError()`` alone, after a lost worker: a trial)
DASK_FAILURE_WORDS = {
    "FutureCancelledError": "Dask cancelled it, as it does when the worker running it is lost or restarted",
    "KilledWorker": "the workers running it died each time (Dask's limit on that)",
    "CommClosedError": "the connection to the Dask worker running it closed",
}


def _with_dask_words(failure: str) -> str:
    """``failure`` (a task's error, as Prefect logged it), said in words where it is one of
    :data:`DASK_FAILURE_WORDS`."""
    name = failure.split("(", 1)[0].split(":", 1)[0].strip().rsplit(".", 1)[-1]
    words = DASK_FAILURE_WORDS.get(name)
    return f"{failure}: {words}" if words else failure


def _keeping_result(fn: Callable[..., Any], done: dict[str, Any]) -> Callable[..., Any]:
    """``fn`` (a flow's function) that also puts what it returns in ``done["summary"]``: a Prefect
    server gone as the run finished failed the run's final state report, and its results, in
    MLflow and S3 by then, were not printed (a trial)."""
    from paperline.infra.pipeline_flow import wrapped_like

    def kept(*args: Any, **kwargs: Any) -> Any:
        from prefect.runtime import flow_run  # noqa: PLC0415

        done["flow_run_id"] = flow_run.get_id()
        done["summary"] = fn(*args, **kwargs)
        return done["summary"]

    return wrapped_like(fn, kept)


def _report(spec: Any, params: Any, summary: dict[str, Any], summary_json: Path | None) -> None:
    """Print a run's summary and write ``--summary-json``."""
    summary = _as_summary(spec.name, summary)
    _print_summary(spec.name, summary)
    _state["reported"] = True  # (after: a Ctrl-C while printing did not leave "the results above")
    if summary_json is not None:
        summary_json.parent.mkdir(parents=True, exist_ok=True)
        # the parameters first: the run's summary alone does not say what it was run with
        record = {"parameters": params.model_dump(mode="json") if hasattr(params, "model_dump") else params,
                  **summary}
        summary_json.write_text(json.dumps(record, indent=2, default=str))
        console.print(f"summary: {summary_json}")


def _others_down() -> str:
    """``"; also down: s3, mlflow"`` for the stack's other services that are not healthy now, ""
    when none is (or their state cannot be read): with the whole stack killed under a run, the
    error named Prefect alone (a trial)."""
    from paperline.infra.stack import stack_status

    try:
        down = [s.name for s in stack_status(_settings()) if s.name != "prefect" and not s.healthy]
    except Exception:  # noqa: BLE001 - a detail of an error already being reported
        return ""
    return f"; also down: {', '.join(down)}" if down else ""


def _prefect_gone(exc: BaseException, info: Any, finished: bool = False) -> Exception | None:
    """The error for a Prefect server that stopped answering during a run (killed, or `paperline
    down` run meanwhile): after Prefect's client had retried for minutes the run ended in
    ``ConnectError: [Errno 111] Connection refused``, naming neither the server nor what to do (a
    trial); so did Prefect's client, checking the server's version as a run started, with
    ``RuntimeError: Failed to reach API at ...`` (raised from the connection error: `down` run as a
    run started, a trial). None when ``exc`` is not a connection error to ``info``'s Prefect server."""
    import httpx

    from paperline.infra.errors import ServiceError
    from paperline.infra.stack import same_endpoint

    if isinstance(exc, RuntimeError) and str(exc).startswith("Failed to reach API at "):
        exc = exc.__cause__ or exc
    if not isinstance(exc, httpx.TransportError):
        return None
    with contextlib.suppress(RuntimeError):  # an error without its request
        if not same_endpoint(str(exc.request.url), info.prefect_api_url):
            return None
    also = _others_down()
    if finished:  # (``finished``: the flow's function had returned, its results printed above)
        # (not "as the run finished": it may have gone earlier, the tasks going on without it: a trial)
        return ServiceError("prefect", f"the server stopped answering before the run's end was recorded "
                                       f"({type(exc).__name__}: {exc}): its work is done (the results above, in "
                                       f"MLflow and S3), but Prefect shows it unfinished{also}; `paperline status` "
                                       "shows what is down and "
                                       "`paperline up` restarts it (the run, left Running, is then marked Crashed "
                                       "once its heartbeats are missed)", url=info.prefect_ui_url)
    return ServiceError("prefect", f"the server stopped answering during the run ({type(exc).__name__}: {exc}), so "
                                   f"the run's end is not recorded there{also}; `paperline status` shows what is down "
                                   "and `paperline up` restarts it (the run, left Running, is then marked Crashed "
                                   "once its heartbeats are missed)", url=info.prefect_ui_url)


def _short(text: str, width: int = 36) -> str:
    """A long path or URI cut to its end (``…/operands/a.npy``), so that a table of runs whose
    operands differ stays readable; the full values are in the comparison's Parquet file."""
    if len(text) <= width or "/" not in text:
        return text
    return "…" + text[-(width - 1):]


HEADER_LINE = 12  # a header line, broken after '_' or a space, need not be narrower than this


def _headers(columns: list[str], rows: list[list[str]], width: int) -> list[str]:
    """Column headers for a table of ``rows`` on a console ``width`` characters wide: as they are
    where the table fits, else broken after each ``.`` (``params.``/``routine``), where rich would
    fold a dotted metric or parameter name mid-word (it breaks lines only at spaces), and a line
    wider than the column's values (and :data:`HEADER_LINE`) after a ``_`` or a space (a named
    metric, ``bytes_sent_per_step``, and ``regression vs best earlier`` were left out at 80
    columns for their headers' width: trials)."""
    natural = sum(max([len(c), *(len(r[i]) for r in rows)]) + 3 for i, c in enumerate(columns)) + 1
    if natural <= width:
        return columns
    out = []
    for i, c in enumerate(columns):
        room = max([HEADER_LINE, *(len(r[i]) for r in rows if i < len(r))])
        lines = []
        for part in c.replace(".", ".\n").split("\n"):
            line = ""
            for word in re.findall(r"[^_ ]+[_ ]?|[_ ]", part):  # words with their '_' or space
                if line and len(line) + len(word.rstrip(" ")) > room:
                    lines.append(line.rstrip(" "))
                    line = ""
                line += word
            lines.append(line.rstrip(" "))
        out.append("\n".join(lines))
    return out


def _integral_columns(rows: list[list[Any]]) -> set[int]:
    """The columns whose values are all whole numbers (MLflow keeps every metric as a float: byte
    counts showed as 78824.0000), shown without decimals; a column with any fraction keeps four."""
    width = max((len(r) for r in rows), default=0)
    whole = set()
    for i in range(width):
        values = [r[i] for r in rows if i < len(r) and isinstance(r[i], float) and math.isfinite(r[i])]
        if values and all(v.is_integer() for v in values):
            whole.add(i)
    return whole


def _print_summary(name: str, summary: dict[str, Any]) -> None:
    from paperline.infra.summary import summary_table

    try:
        table = summary_table(name, summary)
    except Exception as exc:  # noqa: BLE001 - a package's malformed table failed a finished run (a trial)
        err_console.print(f"warning: {name} summary's table could not be shown ({type(exc).__name__}: {exc}); the "
                          "summary is in the flow run's result, MLflow and --summary-json", style="yellow",
                          soft_wrap=True, highlight=False, markup=False)
        table = None
    if table is not None:
        console.print(table)
    _print_tail(summary)


def _print_tail(summary: dict[str, Any]) -> None:
    """The summary's lines (a regression against the best earlier run in red) and the URLs."""
    for line in summary.get("lines", []):
        style = "bold red" if "REGRESSION" in line else None
        console.print(line, soft_wrap=True, highlight=False, markup=False, style=style)
    # (a package's pipeline may leave either out: README, "Your own pipeline")
    if summary.get("prefect_flow_run_url"):
        console.print(f"Prefect flow run: {summary['prefect_flow_run_url']}", soft_wrap=True)
    if summary.get("mlflow_run_url"):
        console.print(f"MLflow run:       {summary['mlflow_run_url']}", soft_wrap=True)


@app.command(cls=_Command)
@_friendly
def demo() -> None:
    """Run every pipeline on its demo preset (bundled real data): the built-in five and those
    installed packages add; a package's pipeline that cannot be loaded is named first and left
    out, a demo that fails is said and the next one runs, and the command then fails naming them."""
    from paperline.flows.pipelines import build_parameters, get_pipeline, pipeline_names

    broken = _say_broken_pipelines("the other pipelines' demos run")  # (one stopped every demo: `make run`)
    failed = []
    for name in pipeline_names():
        if name in broken:
            continue
        try:
            with _said_if_interrupted(), _startup_gc_paused(), _early_cluster() as early:
                spec = get_pipeline(name)
                _run_one(spec, build_parameters(spec, "demo", []), None, early)
        except Exception as exc:  # noqa: BLE001 - said, and the other demos run
            # (the first failure ended every demo after it: compressed-training's 2 ranks on a
            # 1-worker cluster, first in the list, left `make run` with nothing run: a trial);
            # the stack's own failures end them all, as the next demo would meet them too
            from paperline.infra.errors import ServiceError
            from paperline.infra.watch import ServersDied

            if _state["debug"] or isinstance(exc, (ServiceError, ServersDied)):
                raise
            _say_error(exc, prefix=f"{name} demo: ")
            failed.append(name)
    problems = [f"failed: {', '.join(failed)} (above)"] if failed else []
    if broken:
        problems.append(f"left out: {', '.join(broken)}, whose packages' pipelines cannot be loaded (above; "
                        "`paperline params` lists every pipeline)")
    if problems:
        ran = len(pipeline_names()) - len(failed) - len(broken)
        raise PaperlineError(f"demos {'; '.join(problems)}; {ran} ran")


def _say_broken_pipelines(then: str) -> list[str]:
    """Name each installed package's pipeline that cannot be loaded, one ``error:`` line each
    ending in ``then`` (what the command does without it), and return their names."""
    from paperline.flows.pipelines import loadable_pipelines

    _, broken = loadable_pipelines(packages_only=True)  # (the built-in ones load in their turn: early clusters)
    for exc in broken.values():
        err_console.print(f"error: {exc}; {then}", style="red", markup=False, highlight=False, soft_wrap=True)
    return list(broken)


@app.command(cls=_Command)
@_friendly
def trigger(pipeline: Optional[str] = typer.Argument(None, metavar="PIPELINE", help=PIPELINE_HELP),
            preset: Optional[list[str]] = typer.Option(None, "--preset", metavar="NAME",
                                                       help="Start from this preset's values (default: the "
                                                            "deployment's own parameters)."),
            set_: Optional[list[str]] = typer.Option(None, "--set", metavar="KEY=VALUE",
                                                     help="Override a parameter: key=value (repeatable), as `run` takes it."),
            deployment: Optional[str] = typer.Option(None, "--deployment", metavar="NAME",
                                                     help="`local` (what `paperline serve` serves) or the work-pool "
                                                          "deployment's name (`prefect deploy --all`: the flow's "
                                                          "name); default: local while `paperline serve` runs or "
                                                          "where it is unpaused, else the work-pool one where it "
                                                          "exists, else local."),
            watch: bool = typer.Option(False, "--watch", help="Wait for the run to end and print its summary; exit 1 "
                                                              "unless it Completed.")) -> None:
    """Trigger a run of a pipeline's deployment, as the Prefect UI's Run button does: it executes
    where the deployment is served (`paperline serve`) or in a `paperline worker`. --set and
    --preset are checked as `run` checks them, before the run is created. The stack must be up."""
    import httpx

    from paperline.flows.pipelines import get_pipeline, override_values, preset_values

    spec = get_pipeline(_named(pipeline, "trigger"))
    chosen = _one_preset(preset) if preset else None
    if chosen is not None:
        preset_values(spec, chosen)  # an unknown one, before the stack
    names = _deployment_names(spec.flow.name, deployment)
    _refuse_non_json(*override_values(spec, {}, set_ or []))  # a malformed or unknown --set, before the stack
    _quiet_logs()
    # (it started a whole stack to say "no deployment": a trial)
    info = _running_stack("prefect", "`paperline up` (and `paperline serve` or a worker, to execute it) before "
                                     "`paperline trigger`")
    try:
        _trigger(spec, info, names, chosen, set_ or [], watch)
    except httpx.TransportError as exc:  # (a bare "ConnectError: [Errno 111]" as the stack went down: a trial)
        from paperline.infra.errors import redact_url

        raise PaperlineError(f"the Prefect server at {redact_url(info.prefect_api_url)} is not answering "
                             f"({type(exc).__name__}); `paperline status` says what runs, `paperline up` starts it "
                             "again, and the Prefect UI then shows the run's state") from None


def _deployment_names(flow: str, deployment: str | None) -> list[str]:
    """The deployment names `trigger` looks for, in order: ``--deployment`` (``NAME`` or the full
    ``FLOW/NAME`` that trigger prints), else ``local`` and the work-pool one (the flow's name)."""
    from paperline.infra.errors import InputError

    if deployment is None:
        return ["local", flow]
    given, (head, sep, tail) = deployment, deployment.strip().rpartition("/")
    if sep and head != flow:
        raise InputError("--deployment", given, f"a deployment of flow {head!r}, not of {flow!r}; give NAME or {flow}/NAME")
    if not tail:
        raise InputError("--deployment", given, f"empty; give local or {flow} (or {flow}/NAME)")
    return [tail]


def _running_stack(service: str, advice: str) -> Any:
    """The running stack's (or the configured endpoints') info, activated for the clients (its
    logins in their variables); not started (`compare`, `trigger`).

    Args:
        service: the server the command talks to, whose local login must be readable.
        advice: what the "no running stack" error says to do.

    Raises:
        ServiceError: no stack runs here and none is configured.
        PaperlineError: the local ``service``'s login cannot be read.
    """
    from paperline.infra.errors import ServiceError
    from paperline.infra.stack import activate, load_stack_info, login_problem

    settings = _settings()
    info = load_stack_info(settings)
    if info is None:
        raise ServiceError("stack", f"no running stack or configured endpoints; {advice}")
    problem = login_problem(settings, service) if info.service(service).managed else None
    if problem:
        raise PaperlineError(f"{service}: {problem}")
    activate(info)
    return info


def _trigger(spec: Any, info: Any, names: list[str], preset: str | None, overrides: list[str], watch: bool) -> None:
    """:func:`trigger`'s work on the stack's Prefect server (see there)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    from paperline.flows.pipelines import deployment_values, override_values, preset_values
    from paperline.infra.errors import InputError, redact_url

    flow = spec.flow.name
    picked = names != ["local", flow]  # --deployment given
    with get_client(sync_client=True) as client:
        found = {}
        for name in names:
            try:
                found[name] = client.read_deployment_by_name(f"{flow}/{name}")
            except ObjectNotFound:
                continue
        from paperline.infra.flow_runs import serve_lock_holder

        serve_pid = serve_lock_holder(_settings().state_dir)  # (read once: it was, up to 4 times)
        if not found:
            # (deleted under a running serve: "serves" read wrong, a trial)
            serves = (f"the `paperline serve` running (pid {serve_pid}) made {flow}/local as it started: restart it"
                      if serve_pid is not None else f"`paperline serve` serves {flow}/local")
            raise InputError("--deployment" if picked else "pipeline", names[0] if picked else spec.name,
                             f"no deployment {' or '.join(f'{flow}/{n}' for n in names)} on the Prefect server "
                             f"at {redact_url(info.prefect_api_url)}: {serves}, "
                             f"`prefect deploy --all` makes {flow}/{flow} for `paperline worker`")
        # the served one unless its serve stopped (paused) and the work pool's is there (a trial's worker
        # was online while the paused gemm/local got the run); served and paused in the Prefect UI, it
        # still executes a triggered run (the work pool's got it, and no worker ran: a trial)
        serving = serve_pid is not None
        deployment = next((d for d in found.values() if _served_now(d, serving)),
                          next((d for d in found.values() if not d.paused), next(iter(found.values()))))
        served = _served_now(deployment, serving)
        stored = deployment.parameters or {}
        stored_values = deployment_values(stored)
        if stored_values is None:
            # Prefect merges them into every run's, and the run crashed with a traceback in the serve
            # log: "SignatureMismatchError: ... provided with parameters ['m', 'params']" (a trial)
            raise PaperlineError(f"{flow}/{deployment.name}'s own parameters on the Prefect server are "
                                 f"{json.dumps(stored)[:200]}, not {{\"params\": {{...}}}}: its flow takes `params` "
                                 "alone, and any run of it would crash; set them right in the Prefect UI (Edit), or "
                                 "let `paperline serve` (restarted) or `prefect deploy --all` set them anew")
        base = preset_values(spec, preset) if preset is not None else stored_values
        values, given = override_values(spec, base, overrides)
        _refuse_non_json(values, given)
        params, dropped = _trigger_parameters(spec, values, given, base, preset)
        if dropped:  # `run` takes a preset's values as defaults, which the run's inputs override
            _say(f"sent without {', '.join(dropped)} of the preset {preset!r}: the run's inputs decide "
                 f"{'it' if len(dropped) == 1 else 'them'} (as `paperline run` takes a preset's values as defaults)")
            values = {k: v for k, v in values.items() if k not in dropped}
        absolute = _absolute_paths(params)
        if absolute:  # (checked here from this directory, then not found by the run: a trial)
            params = params.model_copy(update=absolute)
            values.update(absolute)
            _say("sent as absolute paths (the run starts in its serve's or worker's own directory): "
                 + ", ".join(f"{k}={v}" for k, v in absolute.items()))
        # the checked values, normalized (`routine=Gemm`, `m="128"`: `run` takes them, and Prefect's schema
        # refused the text as typed with a 409: a trial)
        sent = params.model_dump(mode="json", include=set(values))
        if watch:  # `kill`, a closed terminal: stop watching as Ctrl-C does (they ended it unsaid: a trial)
            from paperline.infra import interrupts

            interrupts.hangup_as_interrupt()
        run = client.create_flow_run_from_deployment(deployment.id, parameters={"params": sent})
        try:
            _say(f"triggered {flow}/{deployment.name}: flow run '{run.name}' {info.flow_run_url(run.id)}")
            if deployment.paused and served:
                _say(f"{flow}/{deployment.name} is paused (in the Prefect UI): its schedule makes no runs, but "
                     "`paperline serve` executes this one")
            waits = _why_it_waits(client, deployment, served,
                                  local=f"{flow}/local" if "local" in found and deployment.name != "local" else None)
            if waits:
                err_console.print(f"warning: {flow}/{deployment.name} {waits}", style="yellow", soft_wrap=True,
                                  highlight=False, markup=False)
            if watch:
                _watch_triggered(client, spec, run)
                _say(f"Prefect flow run: {info.flow_run_url(run.id)}")
        except KeyboardInterrupt:  # (the watch's own line, or this one as the run was just made)
            _say_interrupted(f"interrupted: stopped watching; flow run '{run.name}' goes on (the Prefect UI shows it)")
            raise


def _trigger_parameters(spec: Any, values: dict[str, Any], given: dict[str, str], base: dict[str, Any],
                        preset: str | None) -> tuple[Any, list[str]]:
    """``values`` checked as the triggered run's flow will take them (every value sent counts as
    given there, a preset's too: gemm's `full` m beside --set a=... passed a looser check and
    failed the run as it started, a review) and with `run`'s input checks, made here (a worker
    elsewhere must see these paths). A preset's value that the input checks refuse as given
    (gemm's `full` m, n, k beside operand files) is left out rather than refused, as `run` takes a
    preset's values as defaults (its "leave it out" could not be done: a trial); a refused value
    from the deployment's own parameters is said to be one.

    Returns:
        The parameter model and the preset's keys left out.

    Raises:
        InputError: naming the parameter, and where its value came from when not from --set.
    """
    from paperline.flows.pipelines import validated_parameters
    from paperline.infra.errors import InputError

    def said_from_deployment(exc: Any) -> Exception:
        key = getattr(exc, "argument", "")
        if preset is not None or key in given or key not in base:
            return exc
        # (the user's --set was blamed for it: a trial)
        return InputError(key, exc.value, f"{exc.problem} (the deployment's own value, set on the Prefect server: "
                          f"--set {key}=..., or fix it there)")

    dropped: list[str] = []
    while True:
        kept = {k: v for k, v in values.items() if k not in dropped}
        try:
            params = validated_parameters(spec, kept, {key: given.get(key, repr(v)) for key, v in kept.items()})
        except KernelInputError as exc:
            raise said_from_deployment(exc) from None
        if not hasattr(params, "validate_inputs"):
            return params, dropped
        try:
            params.validate_inputs()
            return params, dropped
        except KernelInputError as exc:
            key = getattr(exc, "argument", "")
            if preset is None or key in given or key not in base or key in dropped:
                raise said_from_deployment(exc) from None
            dropped.append(key)


def _absolute_paths(params: Any) -> dict[str, str]:
    """The parameters that name a local path relative to this directory (the model's
    ``worker_paths``: gemm's operands and output, a tensor's ``data``, a video ``source``), as
    absolute paths: a deployment's run resolves them from the directory of the process that runs
    it. A value that is not itself the path (video-curation's ``demo``) is left as it is."""
    if not hasattr(params, "worker_paths"):
        return {}
    fields = type(params).model_fields
    found: dict[str, str] = {}
    for need in params.worker_paths(_settings().state_dir):
        value = need.value
        if need.argument not in fields or not isinstance(value, str) or value.startswith("s3://") \
                or os.path.isabs(os.path.expanduser(value)) or getattr(params, need.argument) != value:
            continue
        resolved, target = Path(value).expanduser().resolve(), Path(need.path).resolve()
        # the value is the path, holds it (a source directory's videos) or is in it (an output's directory)
        if resolved == target or resolved in target.parents or target in resolved.parents:
            found[need.argument] = os.path.abspath(os.path.expanduser(value))
    return found


def _served_now(deployment: Any, serving: bool | None = None) -> bool:
    """Whether ``deployment`` (Prefect ``DeploymentResponse``) is this stack's `paperline serve`'s
    now, paused or not: no work pool, and this state directory's serve lock held (``serving``, read
    here where None; a serve serves every ``<flow>/local``, one per Prefect server). A paused
    deployment's schedule makes no runs, but its serve executes a run triggered on it (a trial's
    `trigger` said it would wait)."""
    if deployment.work_pool_name:
        return False
    if serving is None:
        from paperline.infra.flow_runs import serve_lock_holder

        # (not its last poll: a trigger in a starting serve's first seconds, before its first poll, went to the
        # work pool's deployment, which no worker ran: a trial)
        serving = serve_lock_holder(_settings().state_dir) is not None
    return serving


def _why_it_waits(client: Any, deployment: Any, served: bool | None = None, local: str | None = None) -> str | None:
    """Why a run of ``deployment`` will not start now, or None: paused (its serve stopped), not
    polled lately, or a work pool with no worker online. ``served``: :func:`_served_now`'s answer,
    read here where None; ``local``: the name of the flow's ``local`` deployment beside a work
    pool's, which the reason then names as the other way to run it."""
    from prefect.client.schemas.filters import WorkerFilter, WorkerFilterStatus

    from paperline.infra.stack import WORK_POOLS

    if served is None:
        served = _served_now(deployment)
    if deployment.paused and served:
        return None  # (its schedule alone is stopped: `trigger` says so)
    if deployment.paused:  # (its runs wait in Scheduled, nothing said)
        return ("is paused (its `paperline serve` stopped, or it was paused in the Prefect UI): the run waits until it "
                "is served again")
    if deployment.work_pool_name:
        online = client.read_workers_for_work_pool(deployment.work_pool_name,
                                                   worker_filter=WorkerFilter(status=WorkerFilterStatus(any_=["ONLINE"])))
        if not online:  # (nothing said: a trial)
            kind = next((k for k, name in WORK_POOLS.items() if name == deployment.work_pool_name), None)
            start = f"`paperline worker --pool {kind}`" if kind else "a worker of the pool"
            waits = f"has no worker of work pool {deployment.work_pool_name} online: the run waits until {start} runs"
            if local is not None:  # (chosen over a paused local one with no serve running: said how else, a trial)
                waits += f"; or run `paperline serve`, which serves {local}, and trigger with `--deployment local`"
            return waits
        return None
    if str(getattr(deployment.status, "value", deployment.status)) == "NOT_READY":  # (a killed serve leaves it unpaused)
        return "has not been polled lately (no `paperline serve` takes its runs now): the run waits until one does"
    return None


TRIGGER_POLL_S = 1.0  # how often `trigger --watch` reads its run's state


def _refuse_non_json(values: dict[str, Any], given: dict[str, str]) -> None:
    """Refuse a NaN or infinite number among a deployment run's parameters: they travel as JSON,
    which has neither, and Prefect sent ``--set x=NaN`` as null (a review).

    Raises:
        InputError: naming the parameter and the value as typed.
    """
    from paperline.flows.pipelines import _AsTyped
    from paperline.infra.errors import InputError

    def finite(v: Any) -> bool:
        if isinstance(v, float):
            return math.isfinite(v)
        if isinstance(v, dict):
            return all(finite(x) for x in v.values())
        if isinstance(v, (list, tuple)):
            return all(finite(x) for x in v)
        return True

    for key, value in values.items():
        if not finite(value):
            raise InputError(key, _AsTyped(given[key]) if key in given else value,
                             "not a finite number: a deployment run's parameters are JSON, which has no NaN or infinity")


def _watch_triggered(client: Any, spec: Any, run: Any) -> None:
    """Follow a triggered run to its end: each state it enters, then the summary its flow logged
    (``infra/pipeline_flow.log_summary``). A Ctrl-C stops watching, not the run.

    Raises:
        PaperlineError: the run ended in a state other than Completed (its message named).
    """
    import time

    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    from paperline.infra.errors import redact_text

    seen, holder, holder_of = None, "", None
    name = spec.flow.fn.__name__.replace("_", "-")
    summary: list[str] = []
    try:
        while True:
            state = client.read_flow_run(run.id).state
            if state is not None:
                if state.name == "AwaitingConcurrencySlot" and state.id != holder_of:  # (each wait is a new state)
                    holder, holder_of = _slot_holder(client, run), state.id  # (the holder changes: a trial)
                shown = state.name + (holder if state.name == "AwaitingConcurrencySlot" else "")
                if shown != seen:
                    seen = shown
                    _say(f"{run.name}: {shown}")
            if state is not None and state.is_final():
                break
            time.sleep(TRIGGER_POLL_S)
        deadline = time.monotonic() + 10  # logs are sent in batches: the last ones may follow the final state
        while state.is_completed():
            # the newest first: a run's logs pass the server's page of 200 (a tile task's lines), and the
            # summary is among the last (a review)
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])), limit=200,
                                    sort=LogSort.TIMESTAMP_DESC)
            summary = [entry.message for entry in logs if entry.message.startswith(f"{name} summary:")][:1]
            if summary or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        _say_interrupted(f"interrupted: stopped watching; flow run '{run.name}' goes on (the Prefect UI shows it)")
        raise
    for text in summary:
        console.print(text.partition("\n")[2], soft_wrap=True, highlight=False, markup=False)
    if state.is_completed() and not summary:
        _say(f"(flow run '{run.name}' logged no summary: its result is in the Prefect UI)")
    if not state.is_completed():
        raise PaperlineError(f"flow run '{run.name}' ended {state.name}: "
                             f"{redact_text(state.message or 'no message')}")


def _slot_holder(client: Any, run: Any) -> str:
    """For a run waiting on its deployment's concurrency slot (one run at a time): `` (the slot is
    held by flow run 'NAME', Running)`` naming the deployment's other runs that hold it, else ``""``
    (it said AwaitingConcurrencySlot and no more: which run to wait for or cancel was a search in
    the UI)."""
    from prefect.client.schemas.filters import (DeploymentFilter, DeploymentFilterId, FlowRunFilter,
                                                FlowRunFilterState, FlowRunFilterStateType)
    from prefect.client.schemas.objects import StateType

    if run.deployment_id is None:
        return ""
    try:
        holders = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[run.deployment_id])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
                any_=[StateType.RUNNING, StateType.PENDING, StateType.CANCELLING]))), limit=5)
    except Exception:  # noqa: BLE001 - a detail of a line: the watch goes on without it
        return ""
    named = [f"'{r.name}', {r.state.name}" for r in holders if r.id != run.id and r.state is not None]
    return f" (the deployment's one slot is held by flow run {'; '.join(named)})" if named else ""


@app.command(cls=_Command)
@_friendly
def serve() -> None:
    """Serve every pipeline as a deployment from this process (no work pool needed): runs
    triggered from the Prefect UI's "Run" button, the API or a schedule execute here, each in
    its own subprocess on its own Dask cluster. Stop with Ctrl-C (schedules are paused then)."""
    import os

    from prefect import serve as prefect_serve

    from paperline.deployments import local_deployments, paused_by_user, read_serve_pauses
    from paperline.flows.pipelines import get_pipeline
    from paperline.infra.cluster import describe_cluster, require_scheduler
    from paperline.infra.errors import redact_url
    from paperline.infra.flow_runs import watch_flow_runs
    from paperline.infra.prefect_patches import recording_runner_pauses, served_runs_in_own_process_group
    from paperline.infra.watch import marking_watch

    _quiet_logs()
    _say_no_workers(require_scheduler(_settings()), _settings())  # the runs served here use it
    info = _ensure_stack()
    with _serve_lock(_settings().state_dir):  # one serve per stack, for as long as this one serves
        _say_broken_pipelines("the other pipelines are served")  # (one stopped serving every one: a trial)
        names = served_names()
        existing = existing_deployments(names)  # (as the Prefect UI left them: kept, not replaced)
        served_elsewhere(existing)  # ... and per Prefect server, which other state dirs may share
        state_dir = _settings().state_dir
        kept_paused = paused_by_user(read_serve_pauses(state_dir), existing, say=_say)  # (a restart unpaused them: a trial)
        # until it stops: the ones it serves unpaused are its own to pause
        _record_pauses(state_dir, [str(d.id) for name, d in existing.items() if name not in kept_paused])
        notes: list[str] = []
        deployments = local_deployments(info.data_bucket, existing, say=notes.append, paused=kept_paused)
        listed = []
        for d in deployments:
            name = f"{d.flow_name}/{d.name}"
            schedules = existing[name].schedules if name in existing else d.schedules or []
            paused = ("; deployment paused, as left in the Prefect UI: its schedules make no runs, a triggered run "
                      "executes" if name in kept_paused else "")
            listed.append(f"{name} ({_schedules_said(schedules, get_pipeline(d.flow_name).cron)}{paused})")
        console.print(f"serving {len(deployments)} deployments: " + ", ".join(listed), highlight=False,
                      soft_wrap=True)  # not folded inside a cron expression in a log file (a trial)
        for note in notes:  # parameters set in the Prefect UI, kept (or no longer valid, replaced)
            console.print(note, highlight=False, soft_wrap=True, markup=False)
        # where their runs compute (`run` said so, `serve` did not: a trial)
        console.print(f"their runs execute here, each on {describe_cluster(_settings())}", highlight=False,
                      soft_wrap=True)
        # (the environment first: PREFECT_API_URL alone, as this said before, got a 401 once the
        # local Prefect required its login, a trial)
        # (`paperline trigger` first: it takes `run`'s --preset/--set and checks them before the run
        # exists; Prefect's CLI needs the stack's environment and nested JSON)
        console.print(f"trigger them from {redact_url(info.prefect_ui_url.rstrip('/'))}/deployments or, in a shell, "
                      f"with `{_state_dir_prefix()}{_on_path('paperline')} trigger gemm --set m=512 --set n=512 "
                      "--set k=512 --watch`, or with Prefect's CLI: "
                      f"`eval \"$({_state_dir_prefix()}{_on_path('paperline')} env)\"` (the stack's URLs and "
                      "logins) then "
                      f"`{_on_path('prefect')} deployment run gemm/local --params "
                      f"'{{\"params\": {{\"m\": 512, \"n\": 512, \"k\": 512}}}}'`; {_stop_serving_hint()}",
                      soft_wrap=True, highlight=False, markup=False)
        # on stopping, a run it was executing, or had claimed and not started, is marked Crashed
        seen: dict[str, int] = {}  # the runs executed here lately (watch_flow_runs fills it in)

        def lost_in_outage(began: Any) -> None:
            try:
                _crash_runs_lost_in_outage(seen, names, began, info.mlflow_tracking_uri)
            except Exception as exc:  # noqa: BLE001 - from the watch's thread or Prefect's poll: say it, serve on
                _say(f"could not check for flow runs the Prefect server's outage lost ({type(exc).__name__}: "
                     f"{exc}); cancel a run left Pending or Running from the Prefect UI")

        # (the watch outermost: the stop's own calls to a Prefect server that is gone fail at once;
        # it sees an outage of the local Prefect server however short, the polls a longer one of any)
        with marking_watch(_settings(), during="while serving",
                           on_back=lambda back: "prefect" in back and lost_in_outage(back["prefect"])), \
                watch_flow_runs("paperline serve", report=_say, deployments=names,
                                tracking_uri=info.mlflow_tracking_uri) as seen, _sigterm_as_ctrl_c(), \
                _serving_through_outages(info.prefect_ui_url, lost_in_outage):
            try:
                try:
                    with served_runs_in_own_process_group(), \
                            recording_runner_pauses(lambda ids: _record_pauses(state_dir, ids)):
                        prefect_serve(*deployments, print_starting_message=False)
                except Exception as exc:
                    # Prefect's runner raises only as it stops, when its goodbye to the server fails:
                    # a serve stopped after `paperline down` ended "error: ConnectError: All connection
                    # attempts failed", exit 1 (a trial); what was left undone is said below
                    from prefect.exceptions import ObjectNotFound

                    if isinstance(exc, ObjectNotFound):  # its pause of a deployment deleted meanwhile ("error:
                        # ObjectNotFound: None", exit 1: a trial); the others are paused below
                        gone = [n for n in names if n not in existing_deployments(names)]
                        _say(f"stopped serving; {', '.join(gone) or 'a deployment it served'} had been deleted from "
                             "the Prefect server meanwhile (the next `paperline serve` makes it again)")
                    elif _prefect_gone(exc, info) is None:
                        raise
                    else:
                        _say(f"stopped serving; its Prefect server at {redact_url(info.prefect_ui_url)} is not "
                             f"answering ({type(exc).__name__}: {exc}): `paperline status` shows what is down")
            finally:
                _pause_served(names, state_dir)


@contextlib.contextmanager
def _serving_through_outages(prefect_url: str, on_back: Callable[[Any], None] | None = None) -> Iterator[None]:
    """`paperline serve` polls on while its Prefect server is away, saying so once, and once more
    when it answers again. Prefect's runner stopped serving after three failed polls in a row:
    ~90 s after its server was killed or stopped (`paperline down`, which says the serve goes on
    after the next `up`), with a page of tracebacks (a trial). A poll fails on a connection error
    or a 5xx (a server starting, a proxy); the outage is said at the second failure in a row, or at
    the first when the serve's watch knows the server is gone (its polls then fail at once rather
    than on Prefect's retries). The runs executing meanwhile fail on their own.

    Args:
        prefect_url: The server, for the lines.
        on_back: Called (in a thread) with the time (UTC) the outage was first seen, once the
            server answers again after one that was said: :func:`_crash_runs_lost_in_outage`.
    """
    import datetime
    import time

    import anyio
    import httpx
    from prefect._internal.observers import FlowRunCancellingObserver
    from prefect.runner._scheduled_run_poller import ScheduledRunPoller

    from paperline.infra.errors import redact_url
    from paperline.infra.watch import down_reason

    original = ScheduledRunPoller._get_and_submit_flow_runs
    away: dict[str, Any] = {}  # since (monotonic), began (UTC), fails (in a row), said

    def outage(exc: BaseException) -> bool:
        return isinstance(exc, httpx.TransportError) or (
            isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code >= 500)

    async def polled(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            await original(self, *args, **kwargs)
        except Exception as exc:
            if not outage(exc):
                raise
            if not away:
                away.update(since=time.monotonic(), began=datetime.datetime.now(datetime.timezone.utc), fails=0)
            away["fails"] += 1
            if not away.get("said") and (away["fails"] >= 2 or down_reason("prefect") is not None):
                away["said"] = True
                _say(f"the Prefect server at {redact_url(prefect_url)} is not answering ({_why_down('prefect', exc)}); "
                     "serving waits for it (runs executing here fail meanwhile) and goes on when it is back "
                     f"(`paperline status` shows what is down; {_stop_serving_hint()})")
            return
        if away:
            gone = away.copy()
            away.clear()
            if gone.get("said"):  # (one failed poll alone: a hiccup, nothing said)
                _say(f"the Prefect server at {redact_url(prefect_url)} answers again after "
                     f"{time.monotonic() - gone['since']:.0f} s: serving goes on")
                if on_back is not None:
                    await anyio.to_thread.run_sync(on_back, gone["began"])

    original_check = FlowRunCancellingObserver._check_for_cancelled_flow_runs

    @functools.wraps(original_check)
    async def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        # the runner's cancellation observer polls the same way while its events stream is down, and
        # stopped for good ("Execution will continue, but flow run cancellation will fail"): a served
        # run could not be cancelled from the UI after an outage. While the server is away it finds
        # nothing to do.
        try:
            await original_check(self, *args, **kwargs)
        except Exception as exc:
            if not (outage(exc) and (away or down_reason("prefect") is not None)):
                raise

    patched = [(ScheduledRunPoller, "_get_and_submit_flow_runs", polled),
               (FlowRunCancellingObserver, "_check_for_cancelled_flow_runs", checked)]
    originals = [(cls, name, getattr(cls, name)) for cls, name, _ in patched]
    for cls, name, fn in patched:
        setattr(cls, name, fn)
    try:
        yield
    finally:
        for cls, name, fn in originals:
            setattr(cls, name, fn)


def _crash_runs_lost_in_outage(seen: dict[str, int], deployments: list[str], began: Any,
                               tracking_uri: str | None = None) -> None:
    """Once serve's Prefect server answers again: mark Crashed the runs the outage lost. A run
    whose process ended meanwhile (its end unrecorded; a Pending one held its deployment's only
    concurrency slot, so its next run waited for good: a trial), and a run claimed (Pending)
    before the outage (``began``) whose process is not there. (A Running run whose process ended
    more than 5 minutes before, which ``seen`` has forgotten, is left to the heartbeat automation.)"""
    from paperline.infra.flow_runs import crash_lost_runs, crash_unstarted_runs, flow_run_processes

    executing = set(flow_run_processes(os.getpid()))
    ended = {run_id: pid for run_id, pid in dict(seen).items() if run_id not in executing}  # (its thread adds)
    why = "its process ended while the Prefect server was away"
    crash_lost_runs(ended, "paperline serve", wait_s=0.0, report=_say, why=why)
    crash_unstarted_runs(deployments, "paperline serve", executing=executing | set(ended), report=_say,
                         why="it was claimed before the Prefect server went away, and no process of it runs now",
                         before=began)
    if tracking_uri is not None and ended:
        # their MLflow runs: the watch's look at them, as each process ended, found Prefect away (a
        # trial's stayed RUNNING until `paperline compare`); `up` may mark a run Crashed a little later
        import threading

        from paperline.infra.tracking import end_runs_of_ended_flow_runs

        threading.Thread(target=end_runs_of_ended_flow_runs, args=(sorted(ended), tracking_uri),
                         kwargs={"waits_s": (0.0, 30.0, 60.0), "report": _say}, daemon=True,
                         name="paperline-mlflow-run-end").start()


def _why_down(service: str, exc: BaseException) -> str:
    """Why ``service`` failed: what this process's server watch knows (the server died, or `paperline
    down` stopped it), else the error ``exc`` itself."""
    from paperline.infra.watch import down_reason

    return down_reason(service) or f"{type(exc).__name__}: {exc}"


def _stop_serving_hint() -> str:
    """How to stop `paperline serve`: Ctrl-C, unless this process ignores SIGINT (started with
    ``&`` from a script: it said "Ctrl-C stops serving" and a SIGINT did nothing, a trial), then
    ``kill PID`` (SIGTERM stops it as Ctrl-C does)."""
    import signal  # noqa: PLC0415

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return (f"`kill {os.getpid()}` stops serving (Ctrl-C does not: this process ignores SIGINT, as a command "
                "started with `&` from a script does)")
    return "Ctrl-C stops serving"


def served_names() -> list[str]:
    """``<flow>/local`` of every pipeline that loads: the deployments `paperline serve` serves."""
    from paperline.flows.pipelines import loadable_pipelines

    return [f"{spec.flow.name}/local" for spec in loadable_pipelines()[0]]


def _state_dir_prefix() -> str:
    """``PAPERLINE_STATE_DIR=<dir> `` when this command's state directory was given by that
    variable, else empty: a printed `paperline env` pasted into another shell pointed at the
    default stack (a trial)."""
    import os
    import shlex

    given = os.environ.get("PAPERLINE_STATE_DIR")
    return f"PAPERLINE_STATE_DIR={shlex.quote(str(_settings().state_dir))} " if given else ""


def _on_path(command: str) -> str:
    """``command`` as a shell finds it: its bare name when ``PATH`` leads to this environment's
    own, else its path in this environment (``.venv/bin/...``: the README's commands, which a
    shell without the venv activated does not find by name; a trial). A command this environment
    lacks stays bare."""
    import shutil

    here = Path(sys.executable).parent / command
    if not here.exists():
        return command
    found = shutil.which(command)
    return command if found and Path(found).resolve() == here.resolve() else str(here)


SERVE_POLLED_WITHIN_S = 30.0  # three of a serve's 10-s polls (Prefect's PREFECT_RUNNER_POLL_FREQUENCY)


def served_elsewhere(deployments: dict[str, Any]) -> None:
    """Refuse to serve deployments that another process serves now on this Prefect server: one of
    ``deployments`` (Prefect ``DeploymentResponse`` by name, as :func:`existing_deployments` read
    them) unpaused and polled within :data:`SERVE_POLLED_WITHIN_S` (a serve polls every 10 s,
    so a killed one blocks a new one for at most that long). The
    serve lock is per state directory; a client configured against a shared Prefect server (or
    another host's serve) served the same deployments, and stopping it paused them all under the
    first serve (a trial). A serve that stopped paused them; one killed outright stops polling.

    Raises:
        PaperlineError: naming the deployments, how long ago they were polled, and the way on.
    """
    import datetime

    from prefect.settings import PREFECT_API_URL

    from paperline.deployments import polled_by_stopped_serve, read_serve_pauses
    from paperline.infra.errors import redact_url

    now = datetime.datetime.now(datetime.timezone.utc)
    own = read_serve_pauses(_settings().state_dir)  # (this stack's serve, stopped: its polls are not another's)
    busy = []
    for name, d in deployments.items():
        ago = (now - d.last_polled).total_seconds() if d.last_polled else None
        if not d.paused and ago is not None and ago <= SERVE_POLLED_WITHIN_S and \
                not polled_by_stopped_serve(own, d.last_polled):
            busy.append((name, ago))
    if busy:
        # (a poll after `now` was taken showed "polled -0 s ago": a CI failure)
        shown = ", ".join(f"{name} (polled {max(0.0, ago):.0f} s ago)" for name, ago in busy[:3]) + (
            f" and {len(busy) - 3} more" if len(busy) > 3 else "")  # (4 counted, 3 named: a trial)
        raise PaperlineError(f"another process serves {len(busy)} of these deployments on the Prefect server at "
                             f"{redact_url(str(PREFECT_API_URL.value()))} now: {shown}; one `paperline serve` per Prefect "
                             "server (two pause each other's deployments when one stops): stop it first, or wait "
                             f"{SERVE_POLLED_WITHIN_S:.0f} s if it was killed")


def existing_deployments(names: list[str]) -> dict[str, Any]:
    """The deployments among ``names`` (``"flow/deployment"``) that exist on the Prefect server
    (Prefect ``DeploymentResponse``), by name: serving them again keeps their schedules as they are,
    and their parameters where valid (:func:`paperline.deployments.local_deployments`). Each serve
    replaced them with the pipelines' own: a schedule paused in the Prefect UI came back active (a
    trial), and one edited or added there, or parameters set there, were lost unsaid. Stopping
    serve pauses the deployments, not their schedules, so each schedule is as someone left it."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    found = {}
    with get_client(sync_client=True) as client:
        for name in names:
            with contextlib.suppress(ObjectNotFound):
                found[name] = client.read_deployment_by_name(name)
    return found


def _schedules_said(schedules: list[Any], cron: str | None) -> str:
    """How `serve` lists a deployment's ``schedules`` (Prefect ``DeploymentSchedule``, or the
    schedules it registers), e.g. ``30 3 * * *`` or ``0 9 * * *, schedule paused; as set on the
    Prefect server (the pipeline's: 30 3 * * *)`` where they differ from the pipeline's ``cron``."""
    def said(entry: Any) -> str:
        when = entry.schedule
        text = (getattr(when, "cron", None) or getattr(when, "rrule", None)
                or (f"every {when.interval}" if getattr(when, "interval", None) else str(when)))
        text = " ".join(text.split())  # (an rrule's DTSTART line broke serve's one line: a trial)
        zone = getattr(when, "timezone", None)
        text += f" {zone}" if zone and zone != "UTC" else ""
        return text if entry.active in (None, True) else f"{text}, schedule paused"

    listed = "; ".join(sorted(said(entry) for entry in schedules)) or "no schedule"  # (the server's order varies)
    own = [cron] if cron else []
    if [getattr(entry.schedule, "cron", None) for entry in schedules] != own or any(
            getattr(entry.schedule, "timezone", "UTC") not in (None, "UTC") for entry in schedules):
        listed += f"; as set on the Prefect server (the pipeline's: {cron or 'none'})"
    return listed


def _record_pauses(state_dir: Path, ids: list[str], add: bool = False, stopped: bool = False) -> None:
    """:func:`paperline.deployments.record_serve_pauses` (``stopped``: stamped with the time now),
    said rather than raised when the state directory cannot be written (the stop goes on)."""
    import datetime

    from paperline.deployments import SERVED_PAUSES, record_serve_pauses

    try:
        record_serve_pauses(state_dir, ids, add=add,
                            stopped_at=datetime.datetime.now(datetime.timezone.utc) if stopped else None)
    except OSError as exc:
        _say(f"could not record which deployments serve paused in {Path(state_dir) / SERVED_PAUSES} ({exc}): the "
             "next `paperline serve` may unpause one paused in the Prefect UI, or keep one it paused itself paused")


def _pause_served(names: list[str], state_dir: Path | None = None) -> None:
    """Pause each of the deployments ``names`` (``"flow/deployment"``) still unpaused: what
    Prefect's runner does as it stops serving, and left undone when the stop interrupted it (a
    trial: SIGTERM during a run paused one of five; the other four kept making Scheduled runs
    that nothing would execute); with ``state_dir``, their ids are added to serve's record of its
    own pauses (:func:`paperline.deployments.paused_by_user`), stamped with the stop's time (its
    polls are over). Errors are reported, not raised: this runs while stopping."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    paused: list[str] = []
    try:
        with get_client(sync_client=True) as client:
            for name in names:
                with contextlib.suppress(ObjectNotFound):
                    deployment = client.read_deployment_by_name(name)
                    if not deployment.paused:
                        client.pause_deployment(deployment.id)
                        paused.append(str(deployment.id))
    except Exception as exc:  # noqa: BLE001 - httpx/prefect errors: say what to do, the stop goes on
        _say(f"could not pause the served deployments' schedules ({type(exc).__name__}: {exc}); their runs wait "
             "Scheduled until the next `paperline serve` (pause them in the Prefect UI to stop that until then: "
             "that serve unpauses them)")
    finally:
        if state_dir is not None:
            _record_pauses(state_dir, paused, add=True, stopped=True)


@contextlib.contextmanager
def _sigterm_as_ctrl_c() -> Iterator[None]:
    """SIGTERM stops `paperline serve` as Ctrl-C does (its runs end Crashed, naming the stop, as
    `paperline worker`'s do): Prefect's runner installs its own SIGTERM handler, which cancelled
    the runs instead, so a supervisor's stop read as a user's deliberate cancel (a trial).

    The SIGINT handler that ``asyncio.run`` installs is called, as for a Ctrl-C: it cancels the
    runner's task, so the runner stops as it does on Ctrl-C (a KeyboardInterrupt raised into the
    loop instead stopped it mid-way, its deployments left unpaused: a trial). Where SIGINT is
    ignored (`paperline serve &` in a script) asyncio installs none, and KeyboardInterrupt is raised.

    SIGHUP (its terminal closed) does the same, unless it is ignored (``nohup``): it ended serve
    at once, and the runs it executes, in sessions of their own
    (:func:`~paperline.infra.prefect_patches.served_runs_in_own_process_group`), would run on
    with nothing to stop them.
    """
    import signal
    import threading

    from prefect.runner import Runner

    def as_ctrl_c(_self: Any, signum: int = signal.SIGTERM, frame: Any = None, *_args: Any, **_kwargs: Any) -> None:
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler) and handler is not signal.default_int_handler:  # asyncio.Runner's _on_sigint
            handler(signal.SIGINT, frame)
        else:
            signal.default_int_handler(signal.SIGINT, frame)

    original = Runner.handle_sigterm
    Runner.handle_sigterm = as_ctrl_c
    hangup = None
    if hasattr(signal, "SIGHUP") and threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        hangup = signal.signal(signal.SIGHUP, lambda signum, frame: as_ctrl_c(None, signum, frame))
    try:
        yield
    finally:
        Runner.handle_sigterm = original
        if hangup is not None:
            signal.signal(signal.SIGHUP, hangup)


def _serve_lock(state_dir: Path) -> Any:
    """The open, exclusively locked ``serve.pid`` of this stack's state directory, to use as a
    context manager (closing it, or the process ending, releases the lock; the file names the PID).

    A second `paperline serve` on the same stack served the same ``<flow>/local`` deployments,
    and when it stopped it paused their schedules under the first one (fresh-user trial).

    Raises:
        PaperlineError: another `paperline serve` holds the lock.
    """
    import fcntl
    import os

    f = open(state_dir / "serve.pid", "a+")  # noqa: SIM115 - kept open: the lock is the open file
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        other = f.read().strip() or "?"
        f.close()
        raise PaperlineError(f"another `paperline serve` (pid {other}) already serves this stack's deployments "
                             f"(state directory {state_dir}); stop it first (Ctrl-C in its terminal, or "
                             f"`kill {other}`): two would pause each other's schedules when one stops") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


@app.command(cls=_Command)
@_friendly
def worker(pool: str = typer.Option("cpu", "--pool", metavar="POOL", help="cpu or gpu (the work pools prefect.yaml uses).")) -> None:
    """Start a Prefect process worker for a paperline work pool, with the stack's environment:
    it executes the runs of deployments created by `prefect deploy --all`. Stop with Ctrl-C."""
    import os
    import subprocess

    import paperline
    from paperline.infra.errors import InputError, redact_url
    from paperline.infra.flow_runs import local_worker_name, watch_flow_runs
    from paperline.infra.stack import WORK_POOLS

    if pool not in WORK_POOLS:
        raise InputError("--pool", pool, f"expected one of {', '.join(WORK_POOLS)}")
    if pool == "gpu":
        from paperline.infra.device import gpu_usable

        if not gpu_usable():  # its runs use device=cuda in this process: every one would fail
            raise InputError("--pool", pool, "no usable CUDA device on this machine (its runs set device=cuda); "
                                             "start the gpu worker on a GPU machine after `make install-gpu`")
    _quiet_logs()
    info = _ensure_stack()  # also creates the work pools
    env = dict(os.environ)  # activate() put the stack's URLs and the heartbeat frequency here
    if pool == "gpu":
        env["PAPERLINE_DEVICE"] = "cuda"
    # Deployment entrypoints are relative paths (flows/gemm.py): run from the package's directory.
    workdir = os.path.dirname(paperline.__file__)
    console.print(f"worker for work pool {WORK_POOLS[pool]} on {redact_url(info.prefect_api_url)} (runs from {workdir}); "
                  "Ctrl-C stops it", soft_wrap=True, highlight=False)
    with watch_flow_runs("paperline worker", report=_say, tracking_uri=info.mlflow_tracking_uri):  # a run it was executing is marked Crashed on stopping
        # named after this process, for `status` to tell a worker that exited from one online (it
        # showed a worker killed seconds before online until its heartbeat aged out: a trial)
        # (Prefect's `prefect worker start`, its log saying a run queued for its slot as waiting)
        code = _worker_through_outages([sys.executable, "-m", "paperline.infra.prefect_worker", "worker", "start",
                                        "--pool", WORK_POOLS[pool], "--type", "process",
                                        "--name", local_worker_name(os.getpid())],
                                       env=env, cwd=workdir, api_url=info.prefect_api_url)
    if code is not None:
        _worker_failed(code, info.prefect_api_url, env.get("PREFECT_API_AUTH_STRING"))


def _worker_through_outages(cmd: list[str], *, env: dict[str, str], cwd: str, api_url: str) -> int | None:
    """Run the Prefect worker ``cmd`` (:func:`_supervise`), starting it again each time it exits
    unasked while its Prefect server at ``api_url`` is not answering, once the server answers
    (:func:`_after_outage`).

    Returns:
        None when it was stopped or ended cleanly; else the exit status of a worker that failed
        with its server answering.
    """
    while True:
        code, stopped = _supervise(cmd, env=env, cwd=cwd, what="the Prefect worker")
        if code == 0 or stopped:
            return None
        again = _after_outage(api_url)
        if again is None:  # stopped while waiting
            return None
        if not again:
            return code


WORKER_WAIT_POLL_S = 5.0  # how often `paperline worker` checks for its Prefect server while waiting for it


def _after_outage(api_url: str) -> bool | None:
    """After the Prefect worker exited unasked: if its Prefect server at ``api_url`` is not
    answering, say so once, wait for it to answer and return True (start the worker again); False
    when it answers (the exit was something else); None when stopped while waiting (Ctrl-C,
    SIGTERM, SIGHUP). Prefect's worker gives up after about 11 minutes of failed polls (its
    backoff; measured) and exited, ending `paperline worker` with "exited with status 1" though `paperline
    down` says it takes runs again after the next `up`."""
    import signal
    import time

    from paperline.infra.errors import redact_url
    from paperline.infra.stack import prefect_problem

    problem = prefect_problem(api_url)
    if problem is None:
        return False
    _say(f"the Prefect worker stopped: its Prefect server at {redact_url(api_url)} is not answering ({problem}); "
         "it starts again when the server answers (`paperline up`; Ctrl-C stops waiting)")

    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    since = time.monotonic()
    try:
        while prefect_problem(api_url) is not None:
            time.sleep(WORKER_WAIT_POLL_S)
    except KeyboardInterrupt:
        return None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _say(f"the Prefect server answers again after {time.monotonic() - since:.0f} s: starting the Prefect worker again")
    return True


def _worker_failed(code: int, api_url: str, login: str | None) -> None:
    """Raise the line for a `prefect worker` that exited with status ``code`` unasked: a login the
    server now refuses is named as such (its own output was a 401 traceback: a trial, the stack's
    login made anew under a running worker, which then exited 0 as if it had been stopped).

    Raises:
        PaperlineError: always.
    """
    from paperline.infra.stack import login_refused

    if login_refused("prefect", api_url, login):
        raise PaperlineError(_not_authorized(_prefect_at(api_url)))
    raise PaperlineError(f"the Prefect worker exited with status {code} (its output above says why)")


def _stop_with_parent(parent: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has Linux send the child SIGINT, its stop signal, when ``parent``
    (the process starting it) dies: a `paperline worker` killed with SIGKILL left its `prefect
    worker` taking runs, unseen by `status` and untouched by `down` (a trial). None elsewhere."""
    import ctypes
    import ctypes.util
    import signal

    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def arm() -> None:  # in the child, between fork and exec
        prctl(1, int(signal.SIGINT), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it died before that took effect
            os.kill(os.getpid(), signal.SIGINT)

    return arm


def _supervise(cmd: list[str], *, env: dict[str, str], cwd: str, grace_s: float = 60.0,
               what: str = "the child process") -> tuple[int, bool]:
    """Run ``cmd`` until it exits; SIGTERM or SIGHUP to this process stop it the way Ctrl-C does.

    ``subprocess.run`` left the child (`prefect worker`, which stops on SIGINT and ignored
    SIGTERM) running under PID 1 when a supervisor or ``kill`` sent SIGTERM to `paperline
    worker`, and it went on taking runs (fresh-user trial). Here the signal is passed on as SIGINT;
    a child still running ``grace_s`` seconds later is killed.

    Started in the background by a shell script (``paperline worker &``), this process, and so
    the child, had SIGINT ignored: the child never stopped and its run went on (fresh-user trial).
    The child then gets SIGINT's default (a signal with a handler is reset on exec, an ignored
    one stays ignored) and a process group of its own, so that a Ctrl-C in the script's terminal
    still passes the background worker by, as the shell meant.

    Returns:
        The child's exit status, and whether it was asked to stop (a signal or Ctrl-C).
    """
    import signal
    import subprocess
    import time

    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # what the child starts with after exec
    try:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, start_new_session=ignored,
                                preexec_fn=_stop_with_parent(os.getpid()))
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    deadline: float | None = None  # when a child asked to stop is killed
    interrupted = False  # a Ctrl-C (it reached the child from the terminal)

    def stop(signum: int | None = None, _frame: object = None) -> None:
        nonlocal deadline
        if signum is not None and deadline is None:  # the child's log will say SIGINT: say what came
            print(f"paperline: {signal.Signals(signum).name} received: stopping {what} (passed on as "
                  f"SIGINT, killed after {grace_s:.0f} s)", file=sys.stderr, flush=True)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        if deadline is None:
            deadline = time.monotonic() + grace_s

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        while proc.poll() is None:
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                if deadline is not None and time.monotonic() > deadline:
                    proc.kill()
            except KeyboardInterrupt:  # a terminal's Ctrl-C reaches the child too: give it a moment first
                interrupted = True
                try:
                    proc.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    stop()  # (an interrupt sent to this process alone)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, interrupted or deadline is not None


MIN_NAME_WIDTH = 12  # a run name shortened (with "…") in compare's table for the ranking metric's room


def _runs_table(experiment: str, result: dict[str, Any], width: int, named: bool = False) -> Table:
    """``compare``'s table of runs for a console ``width`` characters wide: the run id, name and
    status are never folded (``3045c8e│d``, ``FINISHE│D`` with many columns: a trial); the
    parameter and metric columns give way instead. ``named``: the metrics were named with
    ``--metric`` (the caption does not then suggest naming them)."""
    from rich.table import Column

    title = f"{experiment}: {len(result['rows'])} run(s) ({result['selection']})"
    counts = _integral_columns(result["rows"])
    cells = [[(f"{v:.0f}" if i in counts else _fmt(v)) if isinstance(v, float) else _short(str(v))
              for i, v in enumerate(row)] for row in result["rows"]]
    headers = _headers(result["columns"], cells, width)
    # No value is folded either (a test RMSE of 0.0469 showed as "0.0" over "469", which read as two
    # values: a trial): each column is as wide as its widest value and header line, and the columns
    # that do not fit the console after run, name and status are left out, saying so.
    need = [max([len(r[i]) for r in cells if i < len(r)] + [len(line) for line in h.split("\n")])
            for i, h in enumerate(headers)]
    # the metrics (named with --metric, or the headlines) take the room first, then the parameters
    # that differ: at 80 columns a named metric was left out for params.output (a trial)
    metrics = set(result.get("metrics") or [])
    order = [*range(3), *[i for i in range(3, len(need)) if result["columns"][i] in metrics],
             *[i for i in range(3, len(need)) if result["columns"][i] not in metrics]]
    # the metrics (the one runs are sorted by first), before whole run names: at 80 columns nas's
    # long names left the ranking metric out, and compressed-training's the second --metric (trials)
    shown = [i for i in order[3:] if result["columns"][i] in metrics]
    excess = 1 + sum(need[i] + 3 for i in range(3)) + sum(need[i] + 3 for i in shown) - width
    if excess > 0 and need[1] > MIN_NAME_WIDTH:
        need[1] = max(MIN_NAME_WIDTH, need[1] - excess)
        for row in cells:
            if len(row[1]) > need[1]:  # the middle goes: names differ by their ends (a campaign's digest)
                head = (need[1] - 1) // 2
                row[1] = row[1][:head] + "…" + row[1][len(row[1]) - (need[1] - 1 - head):]
    kept, used = [], 1  # the table's left border
    for i in order:
        if i < 3 or used + need[i] + 3 <= width:  # two spaces of padding and a border per column
            kept.append(i)
            used += need[i] + 3
    kept.sort()
    left_out = [result["columns"][i] for i in range(len(headers)) if i not in kept]
    # --metric names metrics only: for parameters left out, or metrics already named, a wider
    # terminal is the way (it was suggested for a metric named with --metric: a trial)
    hint = ("name the metrics to show with --metric" if not named and any(not c.startswith("params.")
                                                                         for c in left_out)
            else f"set a larger COLUMNS (now {os.environ['COLUMNS']})" if os.environ.get("COLUMNS")
            else "widen the terminal (or set COLUMNS)")
    caption = (f"{len(left_out)} column(s) left out for the console's width ({width}): "
               f"{', '.join(left_out)}; all are in the Parquet file below, or {hint}" if left_out else None)
    table = Table(*[Column(headers[i], overflow="fold", no_wrap=i < 3,  # run, name, status (a metric may be named "name")
                           min_width=need[i]) for i in kept], title=title, caption=caption)
    for row in cells:
        table.add_row(*[row[i] for i in kept if i < len(row)])
    return table


def joined_filters(filters: list[str]) -> str:
    """``compare``'s ``--filter`` options as one MLflow filter: each must hold (a second
    ``--filter`` replaced the first, unsaid: a trial). MLflow's filters have ``and``, no ``or``."""
    return " and ".join(f for f in (f.strip() for f in filters) if f)


@app.command(cls=_Command)
@_friendly
def compare(experiment: str = typer.Argument(..., metavar="EXPERIMENT", help="MLflow experiment, e.g. gemm or tensor-factorization."),
            metric: list[str] = typer.Option([], "--metric", "-m", metavar="METRIC", help="Metric to show and plot (repeatable)."),
            filter_string: list[str] = typer.Option([], "--filter", metavar="EXPR",
                                                    help="MLflow filter, e.g. \"params.routine = 'gemm'\" "
                                                         "(repeatable: all must hold)."),
            top: int = typer.Option(10, "--top", metavar="N", help="At most this many runs, sorted by the first metric."),
            ascending: bool = typer.Option(False, "--ascending", help="Sort ascending, whatever the metric (without "
                                                                   "--metric too). Default: the metric's "
                                                                   "own direction where its pipeline records one, "
                                                                   "else ascending for times and losses (names "
                                                                   "ending in _s, or with loss, rmse, residual or "
                                                                   "error in them), else descending."),
            out: Path = typer.Option(Path("paperline-compare"), "--out", metavar="DIR",
                                     help="Directory for the Parquet file and the plot."),
            log: bool = typer.Option(False, "--log", help="Also log the comparison as an MLflow run."),
            all_runs: bool = typer.Option(False, "--all-runs", help="Every run, not only the runs each pipeline "
                                                                   "compares (nas: campaigns, not evaluations; "
                                                                   "cached copies of earlier runs too).")
            ) -> None:
    """Compare an experiment's MLflow runs: a table, an overlay plot of step-wise metrics and a
    Parquet file of the runs."""
    from paperline.flows.compare import compare_runs
    from paperline.infra.tracking import Tracker

    info = _running_stack("mlflow", "run `paperline up` first")  # (its login: else MLflow's bare 401, a trial)
    result = compare_runs(Tracker(info.mlflow_tracking_uri), experiment, list(metric), joined_filters(filter_string),
                          top, out, log,
                          ascending, all_runs)
    _print_comparison(experiment, result, Console().width, named=bool(metric))


def _print_comparison(experiment: str, result: dict[str, Any], width: int, named: bool) -> None:
    """`compare`'s output: the runs' table and its note at the terminal's ``width`` (COLUMNS; the
    note was wrapped at the 140 columns the module's console keeps for URLs: a trial), then where
    the Parquet file and the plot are, and the comparison's MLflow run."""
    console.print(_runs_table(experiment, result, width, named=named), width=width)
    if result["note"]:
        console.print(result["note"], highlight=False, width=width)
    plot = result["plot"] or "none (these runs share no metric: name some with --metric)"
    console.print(f"runs: {result['parquet']}\nplot: {plot}", highlight=False, soft_wrap=True)
    if result["comparison_run_id"]:
        console.print(f"logged as MLflow run {result['comparison_run_id']}", highlight=False)


class LineEndTracker:
    """A text stream that forwards everything to ``inner`` and remembers whether the last text
    written ended a line (``at_line_start``), so that the CLI's last line starts on a line of its
    own after a library's ``sys.stderr.write`` without a newline (Prefect's log worker writes its
    error so when the server has gone)."""

    API_LOG_ERROR = "--- Error logging to API ---\n"  # Prefect's APILogWorker; its error text follows, unended

    def __init__(self, inner: Any):
        self._inner = inner
        self.at_line_start = True
        self._api_log_error = False

    def write(self, text: str) -> int:
        """Write ``text`` to ``inner`` and record whether it ends a line (empty text leaves
        that as it was). Text written right after Prefect's :attr:`API_LOG_ERROR` header gets the
        newline it lacks. Returns what ``inner.write`` returns (characters written)."""
        if self._api_log_error and text and not text.endswith("\n"):
            text += "\n"  # else the next log line was glued onto it ("...attempts failed14:52:07.120 | WARNING")
        self._api_log_error = text == self.API_LOG_ERROR
        if text:
            self.at_line_start = text.endswith("\n")
        return self._inner.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, ...
        return getattr(self._inner, name)


def main() -> None:
    """Console-script entry point: runs the command, then exits through :func:`_exit`.
    ``kill -USR1 <pid>`` prints every thread's Python stack to stderr (a command that seems stuck)."""
    import faulthandler
    import signal

    if sys.stderr is not None and hasattr(signal, "SIGUSR1"):
        try:
            faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
        except (ValueError, OSError, AttributeError):  # a stderr without a file descriptor
            pass
    if sys.stderr is not None and not isinstance(sys.stderr, LineEndTracker):
        sys.stderr = LineEndTracker(sys.stderr)
    _state["own_process"] = True  # (in-process callers, tests among them, keep their collector as it is)
    try:
        app()
        code: Any = 0
    except SystemExit as exc:
        code = exc.code
    _exit(code)


EXIT_HOOKS_S = 15.0  # the most the exit hooks (Prefect's drains to its server) may take


def _exit(code: Any) -> None:
    """Exit the way the interpreter does (join non-daemon threads, run the ``atexit`` hooks:
    Prefect's log and event drains, logging's flush), then ``os._exit``, skipping the teardown
    of every module's objects that follows: after a pipeline run (Prefect, MLflow, pydantic,
    Dask and the pipeline's numerics loaded) that teardown alone took 0.9 s on this 2-core machine,
    7% of a cached ``paperline run tensor-factorization``. After the Prefect server went away
    during the run (:func:`_prefect_gone`) the hooks are skipped: their drains retried it for 100 s;
    otherwise they get :data:`EXIT_HOOKS_S` seconds.

    Args:
        code: ``SystemExit.code``: None (0), an int, or a message (printed to stderr; exit 1).
    """
    import atexit
    import os
    import threading
    import time

    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    if not _state.get("prefect_gone"):  # else their drains retried the dead server for 100 s more
        # What Py_Finalize does, with the hooks on a thread, waited for EXIT_HOOKS_S in all: with the
        # stack stopped as a run finished, its results printed, Prefect's drains retried the dead
        # server for 72 s, and after a Ctrl-C under memory pressure a drain among threading's exit
        # callbacks held the exit for minutes (two trials). threading._shutdown itself stays on
        # the main thread (it joins every non-daemon thread, the main one too).
        deadline = time.monotonic() + EXIT_HOOKS_S
        callbacks = list(reversed(threading._threading_atexits))  # run first by threading._shutdown
        threading._threading_atexits.clear()

        def bounded(fn: Any) -> bool:
            hooks = threading.Thread(target=fn, name="paperline-exit-hooks", daemon=True)
            hooks.start()
            hooks.join(max(0.0, deadline - time.monotonic()))
            return not hooks.is_alive()

        try:
            done = bounded(lambda: [call() for call in callbacks])
            if done:
                threading._shutdown()  # joins the non-daemon threads (executors' workers)
                done = bounded(atexit._run_exitfuncs)
        except KeyboardInterrupt:  # a second Ctrl-C while it waited printed a traceback (a trial): exit now
            print("paperline: interrupted again: exiting without Prefect's last logs and events", file=sys.stderr)
            code = code or 130
        else:
            if not done:
                print(f"paperline: exiting without Prefect's last logs and events: its server did not take them within "
                      f"{EXIT_HOOKS_S:.0f} s (`paperline status` shows what is down)", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
