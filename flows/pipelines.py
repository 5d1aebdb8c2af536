"""The registry of pipelines the CLI and the deployments can run: the five built in, and those
other installed packages add through the ``paperline.pipelines`` entry-point group (README,
"Your own pipeline")."""

from __future__ import annotations

import collections.abc
import functools
import json
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

from paperline.infra.errors import InputError, input_error_from
from paperline.kernels.errors import unknown_name
from paperline.kernels.registry import Registry


@dataclass(frozen=True)
class Pipeline:
    """A runnable pipeline: its flow, its parameter model and named presets.

    A package of one's own adds a pipeline by naming an instance of this class in the
    ``paperline.pipelines`` entry-point group (:data:`ENTRY_POINT_GROUP`; README, "Your own
    pipeline"): ``paperline run``, ``params``, ``demo``, ``serve`` and ``compare`` then take it by
    ``name``. What :func:`get_pipeline` checks as it loads one: ``name`` is the entry point's and
    ``flow``'s name; ``flow`` is a Prefect flow whose function takes the parameters as ``params``;
    ``parameters`` is a pydantic model; ``presets`` has ``demo`` (what `paperline run` and
    `paperline demo` run by default) and each preset is valid for the model and sets only its
    fields; ``deployment_parameters`` is ``{"params": {...}}`` valid for the model; ``cron`` is a
    cron schedule.
    """

    name: str
    flow: Callable[..., Any]
    parameters: type[BaseModel]
    presets: dict[str, dict[str, Any]]
    cron: str | None = None  # the deployment's schedule, UTC (`paperline serve` and prefect.yaml)
    description: str = ""
    # the deployment's parameters (both ways of deploying; "{data_bucket}" is the stack's data bucket)
    deployment_parameters: dict[str, Any] = field(default_factory=dict)

    def deployment_params(self, data_bucket: str) -> dict[str, Any]:
        """:attr:`deployment_parameters` with ``{data_bucket}`` filled in."""
        def fill(v: Any) -> Any:
            if isinstance(v, str):
                return v.replace("{data_bucket}", data_bucket)
            if isinstance(v, dict):
                return {k: fill(x) for k, x in v.items()}
            if isinstance(v, list):
                return [fill(x) for x in v]
            return v

        return fill(self.deployment_parameters)


PIPELINES: Registry[Pipeline] = Registry("pipeline")

ENTRY_POINT_GROUP = "paperline.pipelines"  # name = the pipeline's name, value = "module:Pipeline instance"


# name -> (module, flow, parameter model, deployment cron (UTC), description, deployment parameters);
# a module is imported only when its pipeline is asked for, so `paperline run gemm` does not import
# the NAS or video stacks. prefect.yaml holds the same schedules and parameters (tests/test_layout.py).
_BUILTIN: dict[str, tuple[str, str, str, str, str, dict[str, Any]]] = {
    "tensor-factorization": ("paperline.flows.tensor_factorization", "tensor_factorization",
                             "TensorFactorizationParameters", "0 2 * * *",
                             "P²T²F against TensorLy CP on the bundled real tensors (nightly).", {}),
    "gemm": ("paperline.flows.gemm", "gemm", "GemmParameters", "30 3 * * *",
             "Tiled level-3 BLAS health benchmark: GFLOP/s against NumPy, verified (daily).", {}),
    "nas": ("paperline.flows.nas", "nas", "NasParameters", "0 4 * * 0",
            "NAS campaign: LaMOO on NAS-Bench-201 (weekly, the seeded campaign from scratch: resume=false; "
            "its evaluations come from the task cache), parent/child runs in MLflow.",
            {"params": {"resume": False}}),
    "compressed-training": ("paperline.flows.compressed_training", "compressed_training",
                            "CompressedTrainingParameters", "0 5 * * 6",
                            "Data-parallel training with every gradient compressor against dense (weekly).",
                            {"params": {"compressors": ["none", "fft", "topk", "powersgd", "fp16"]}}),
    "video-curation": ("paperline.flows.video_curation", "video_curation", "VideoCurationParameters", "0 1 * * *",
                       "The videos under s3://<data bucket>/video-curation/incoming/ to WebDataset shards + "
                       "Parquet index, a dataset per night (nightly-<date>) of every video there then: split, "
                       "transcode, filter, dedup.",
                       {"params": {"source": "s3://{data_bucket}/video-curation/incoming/",
                                   "dataset": "nightly-{date}"}}),
}


def _register_builtin(name: str) -> None:
    if name in PIPELINES or name not in _BUILTIN:
        return
    import importlib  # noqa: PLC0415

    module, flow, parameters, cron, description, deployment_parameters = _BUILTIN[name]
    m = importlib.import_module(module)
    PIPELINES.register(name)(Pipeline(name, getattr(m, flow), getattr(m, parameters), m.PRESETS, cron=cron,
                                      description=description, deployment_parameters=deployment_parameters))


def get_pipeline(name: str) -> Pipeline:
    """The pipeline called ``name``, importing only its module (a built-in one's, or the package's
    that names it in the ``paperline.pipelines`` entry-point group).

    Raises:
        InputError: ``name`` is no pipeline's (the message lists the known ones).
        PaperlineError: an installed package's entry point of that name cannot be loaded, or what
            it names is not a valid :class:`Pipeline` (the message names the entry point, its
            package and what is wrong).
    """
    _register_builtin(name)
    if name in _FAILED:  # (a broken package was imported again at each look: three times per serve, a review)
        raise _FAILED[name]
    if name not in PIPELINES and (entry_point := _entry_points().get(name)) is not None:
        try:
            PIPELINES.register(name)(_load_entry_point(entry_point))
        except Exception as exc:
            _FAILED[name] = exc
            raise
    if name not in PIPELINES:
        raise InputError("pipeline", name, unknown_name("pipeline", name, pipeline_names()))
    return PIPELINES[name]


def loadable_pipelines(packages_only: bool = False) -> tuple[list[Pipeline], dict[str, Exception]]:
    """Every pipeline that loads, in name order, and the error of each package's pipeline that does
    not (by name): `paperline demo` and `serve` run and serve the others (one package's broken
    entry point stopped both for every pipeline: a trial). A built-in pipeline's error is raised.
    ``packages_only``: look at the packages' pipelines alone (importing no built-in one)."""
    from paperline.infra.errors import PaperlineError  # noqa: PLC0415

    loaded, broken = [], {}
    for name in pipeline_names():
        if packages_only and name in _BUILTIN:
            continue
        try:
            loaded.append(get_pipeline(name))
        except PaperlineError as exc:
            if name in _BUILTIN:
                raise
            broken[name] = exc
    return loaded, broken


def builtin_pipeline_names() -> list[str]:
    """The five built-in pipelines' names, sorted (what ``prefect.yaml`` deploys)."""
    return sorted(_BUILTIN)


def pipeline_names() -> list[str]:
    """Every pipeline's name (sorted): the built-in ones, those registered in this process and
    those installed packages name in the ``paperline.pipelines`` entry-point group, without
    importing any of them."""
    return sorted(set(PIPELINES.names()) | set(_BUILTIN) | set(_entry_points()))


_FAILED: dict[str, Exception] = {}  # a package's pipeline that could not be loaded, by name: its error


def _installed_entry_points() -> list[Any]:
    """The ``paperline.pipelines`` entry points of the installed distributions, as
    ``importlib.metadata`` lists them (the tests narrow this to the packages they install)."""
    from importlib.metadata import entry_points  # noqa: PLC0415

    return list(entry_points(group=ENTRY_POINT_GROUP))


@functools.cache
def _entry_points() -> dict[str, Any]:
    """The ``paperline.pipelines`` entry points of the installed distributions, by name (read from
    their metadata, nothing imported). One named like a built-in pipeline is left out, and of two
    packages naming one pipeline the first listed is used, each said once per process on stderr as
    one ``warning:`` line: the built-in one keeps its name (its deployments and MLflow experiment
    are the stack's), and a package could otherwise replace it unseen."""
    found: dict[str, Any] = {}
    for entry_point in _installed_entry_points():
        where = _package_of(entry_point)
        if entry_point.name in _BUILTIN:
            _warn(f"{ENTRY_POINT_GROUP} entry point {entry_point.name!r} = {entry_point.value!r} of {where} is left "
                  f"out: {entry_point.name} is a built-in pipeline's name; give it another")
        elif entry_point.name in found and found[entry_point.name].value != entry_point.value:
            # two packages claim the name (importlib.metadata lists one distribution once)
            first = found[entry_point.name]
            _warn(f"{ENTRY_POINT_GROUP} entry point {entry_point.name!r} is named by {_package_of(first)} "
                  f"({first.value!r}) and by {where} ({entry_point.value!r}): {_package_of(first)}'s is used; "
                  "uninstall one, or rename its entry point")
        else:
            found.setdefault(entry_point.name, entry_point)
    return found


def _warn(line: str) -> None:
    """One ``warning:`` line on stderr (Python's ``warnings`` printed a file path and a line of
    paperline's code with it: a trial)."""
    sys.stderr.write(f"warning: {line}\n")


def package_of_pipeline(name: str) -> str:
    """Where pipeline ``name`` comes from: ``paperline`` (built in), the package whose
    ``paperline.pipelines`` entry point names it (``mypkg 0.1``), or ``this process`` (registered
    in :data:`PIPELINES` by code of the caller's)."""
    if name in _BUILTIN:
        return "paperline"
    if (entry_point := _entry_points().get(name)) is not None:
        return _package_of(entry_point)
    return "this process"


def _package_of(entry_point: Any) -> str:
    """``mypkg 0.1`` for an entry point (``an unnamed package`` when its metadata has no name)."""
    dist = getattr(entry_point, "dist", None)
    if dist is None or not dist.metadata.get("Name"):
        return "an unnamed package"
    return f"{dist.metadata['Name']} {dist.version}"


def _load_entry_point(entry_point: Any) -> Pipeline:
    """Import what a ``paperline.pipelines`` entry point names and check that it is a pipeline the
    CLI and the deployments can run (see :class:`Pipeline`).

    Raises:
        PaperlineError: naming the entry point, its package and what is wrong.
    """
    from paperline.infra.errors import PaperlineError  # noqa: PLC0415

    where = f"pipeline {entry_point.name!r} ({ENTRY_POINT_GROUP} entry point {entry_point.value!r} of " \
            f"{_package_of(entry_point)})"
    try:
        pipeline = entry_point.load()
    except Exception as exc:  # noqa: BLE001 - any import-time failure of a package of someone else's
        first = (str(exc).splitlines() or [""])[0]
        raise PaperlineError(f"{where} could not be loaded: {type(exc).__name__}: {first}") from exc
    if not isinstance(pipeline, Pipeline):
        raise PaperlineError(f"{where} names a {type(pipeline).__name__}, not a "
                             "paperline.flows.pipelines.Pipeline")
    try:
        problems = _pipeline_problems(pipeline, entry_point.name)
    except Exception as exc:  # noqa: BLE001 - fields of any type (presets not a dict): said, not an AttributeError
        problems = [f"it could not be checked ({type(exc).__name__}: {exc})"]
    if problems:
        raise PaperlineError(f"{where}: " + "; ".join(problems))
    return pipeline


def _pipeline_problems(pipeline: Pipeline, name: str) -> list[str]:
    """What keeps a package's ``pipeline`` (its entry point called ``name``) from being run, listed
    and served (see :class:`Pipeline`); empty when nothing does."""
    import inspect  # noqa: PLC0415

    from prefect import Flow  # noqa: PLC0415

    problems = []
    if pipeline.name != name:
        problems.append(f"its name is {pipeline.name!r}, not the entry point's {name!r}")
    if not isinstance(pipeline.flow, Flow):
        problems.append(f"its flow is a {type(pipeline.flow).__name__}, not a Prefect flow "
                        "(paperline.infra.pipeline_flow.pipeline_flow makes one)")
    elif pipeline.flow.name != pipeline.name:  # (a package's flow named gemm took gemm/local over: a trial)
        problems.append(f"its flow is named {pipeline.flow.name!r}, not {pipeline.name!r} (a flow's deployments are "
                        "<flow name>/local and its name is the pipeline's)")
    elif "params" not in inspect.signature(pipeline.flow.fn).parameters:
        problems.append(f"its flow {pipeline.flow.name!r} takes no `params` argument (deployments and "
                        "`paperline run` pass the parameters as params)")
    if not (isinstance(pipeline.parameters, type) and issubclass(pipeline.parameters, BaseModel)):
        problems.append(f"its parameters are {pipeline.parameters!r}, not a pydantic model class")
    elif "demo" not in pipeline.presets:
        problems.append(f"it has no `demo` preset (presets: {', '.join(pipeline.presets) or 'none'}; "
                        "`paperline run` and `paperline demo` run demo by default)")
    else:
        for preset, values in pipeline.presets.items():
            if unknown := sorted(set(values) - set(pipeline.parameters.model_fields)):  # (dropped unsaid: a trial)
                problems.append(f"its preset {preset!r} sets {', '.join(unknown)}, not parameters of "
                                f"{pipeline.parameters.__name__}")
                continue
            problems += _invalid(pipeline.parameters, values, f"its preset {preset!r} is")
        # what `serve` deploys: a bad cron or deployment parameters stopped serving every pipeline (a review)
        params = pipeline.deployment_params("paperline-data")
        values = deployment_values(params)
        if values is None:
            problems.append(f"its deployment_parameters are {params!r}, not {{'params': {{...}}}}")
        else:
            problems += _invalid(pipeline.parameters, values, "its deployment_parameters are")
    if pipeline.cron is not None:
        from prefect.schedules import Cron  # noqa: PLC0415

        try:
            Cron(pipeline.cron, timezone="UTC")
        except Exception as exc:  # noqa: BLE001 - pydantic's or croniter's, as it comes
            problems.append(f"its cron {pipeline.cron!r} is not a cron schedule ({(str(exc).splitlines() or [''])[0]})")
    return problems


def deployment_values(parameters: Any) -> dict[str, Any] | None:
    """The parameter values in a deployment's parameters, which are ``{"params": {...}}`` (every
    pipeline's flow takes ``params`` alone): ``{}`` for ``{}`` or ``{"params": null}`` (the
    defaults; Prefect stores the latter), or None when ``parameters`` are not of that shape (other
    keys beside ``params``, or ``params`` not a JSON object). Used by the package check, by `serve`
    for the parameters it keeps, and by `trigger` for those it refuses."""
    if not isinstance(parameters, dict) or set(parameters) - {"params"}:
        return None
    values = parameters.get("params")
    if values is None:
        return {}
    return values if isinstance(values, dict) else None


def validation_problem(model: type[BaseModel], values: dict[str, Any]) -> str | None:
    """``"<field>: <reason>"`` for the first error of ``values`` against ``model`` (a nested field
    dotted: ``schedule.cron``), or None when they are valid."""
    try:
        model.model_validate(values)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return f"{where}: {first['msg'].removeprefix('Value error, ')}" if where else first["msg"]
    return None


def _invalid(model: type[BaseModel], values: dict[str, Any], what: str) -> list[str]:
    """``["<what> not valid for <model>: <field>: <reason>"]`` when ``values`` fail the model (``what``
    ends in its verb: "its preset 'full' is"), else empty."""
    problem = validation_problem(model, values)
    return [] if problem is None else [f"{what} not valid for {model.__name__}: {problem}"]


def _members(annotation: Any) -> set[Any]:
    """The alternatives of a union annotation (``int | None`` -> ``{int, None}``), else itself."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return set(typing.get_args(annotation))
    return {annotation}


def _is_list(annotation: Any) -> bool:
    """``list[...]``, also inside ``Optional``/``|`` unions (``list[str] | None``)."""
    return any(typing.get_origin(a) is list for a in _members(annotation))


def _numeric_not_bool(annotation: Any) -> bool:
    """``int``/``float`` (also inside ``Optional``) with no ``bool`` alternative: pydantic would
    read ``true`` there as 1 (``q=true`` started a campaign with q = 1)."""
    members = _members(annotation)
    return bool(members & {int, float}) and bool not in members


class PipelineParameters(BaseModel):
    """Base of the built-in pipelines' parameter models (a package's own may use it too): unknown
    fields are refused (``mm=5``, a misspelt ``m``, was ignored), NaN and infinities are refused
    ("should be a finite number"), and so is a boolean given for a number, alone or inside a
    list, tuple, set or dict of numbers, as ``--set m=true`` is (:func:`override_values`), from
    Python, from a deployment run's parameters and from the Prefect UI alike; pydantic's lax mode
    read ``True`` there as 1 (``GemmParameters(m=True)`` multiplied a 1-row matrix: a review).
    A model changed after it was built is checked again as the flow is called
    (:class:`paperline.infra.pipeline_flow.PipelineFlow`).

    Raises:
        pydantic.ValidationError: naming the field, e.g. "expected a number, not a boolean".
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, v: Any, info: ValidationInfo) -> Any:
        field_info = cls.model_fields.get(info.field_name or "")
        if field_info is None:
            return v
        if isinstance(v, bool) and _numeric_not_bool(field_info.annotation):
            raise ValueError("expected a number, not a boolean")
        items = list(v.values()) if isinstance(v, dict) else list(v) if isinstance(v, list | tuple | set | frozenset) else []
        if any(isinstance(x, bool) for x in items) and _numbers_inside(field_info.annotation):
            at = next(i for i, x in enumerate(items) if isinstance(x, bool))
            where = f"the value of {list(v)[at]!r}" if isinstance(v, dict) else f"item {at}"
            raise ValueError(f"expected numbers, not a boolean ({where})")
        return v


def _numbers_inside(annotation: Any) -> bool:
    """Whether ``annotation`` (``list[int]``, ``tuple[float, float]``, ``dict[str, int]``, also
    inside ``Optional``) holds numbers that are not booleans: its items (a dict's values)."""
    for member in _members(annotation):
        origin, args = typing.get_origin(member), typing.get_args(member)
        if origin is dict and len(args) == 2:
            args = args[1:]
        elif origin not in (list, tuple, set, frozenset, collections.abc.Sequence, collections.abc.Set):
            continue
        if any(_numeric_not_bool(_unannotated(a)) for a in args if a is not Ellipsis):
            return True
    return False


def _unannotated(annotation: Any) -> Any:
    """``Annotated[int, Field(ge=1)]`` -> ``int``; anything else as it is."""
    return typing.get_args(annotation)[0] if typing.get_origin(annotation) is typing.Annotated else annotation


def _text(annotation: Any) -> bool:
    """``str``, ``list[str]``, or either ``| None``: a name such as ``dataset=2024`` or
    ``campaign=123`` is text there, not the number JSON reads."""
    members = _members(annotation) - {type(None)}
    if len(members) != 1:
        return False
    (member,) = members
    return member is str or (typing.get_origin(member) is list and typing.get_args(member) == (str,))


def _scalar(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class _AsTyped(str):
    """A ``--set`` value shown as typed: ``fps=1e9``, not ``fps='1e9'`` (it was a number, and the
    quotes read as if it had been taken as text)."""

    def __repr__(self) -> str:
        return str(self)


def _json_non_text(raw: str) -> bool:
    """``raw`` parses as JSON other than a string (a number, bool, null, list or object)."""
    try:
        return not isinstance(json.loads(raw), str)
    except json.JSONDecodeError:
        return False


def build_parameters(pipeline: Pipeline, preset: str, overrides: list[str]) -> BaseModel:
    """Parameters from a preset plus ``key=value`` overrides.

    Values are parsed as JSON when they parse (``5``, ``0.1``, ``["a"]``), otherwise taken as
    strings; list-valued parameters also take comma-separated values (``datasets=kinetic,produc``,
    ``ref_point=80,2``) and a single value (``objectives=val_accuracy_pct``).

    Raises:
        InputError: unknown preset, malformed override, unknown parameter or invalid value.
    """
    values, given = override_values(pipeline, preset_values(pipeline, preset), overrides)
    return validated_parameters(pipeline, values, given)


def preset_values(pipeline: Pipeline, preset: str) -> dict[str, Any]:
    """The values of ``pipeline``'s preset called ``preset``.

    Raises:
        InputError: no such preset (the message lists the pipeline's).
    """
    if preset not in pipeline.presets:
        raise InputError("--preset", preset, unknown_name("preset", preset, sorted(pipeline.presets)))
    return pipeline.presets[preset]


def override_values(pipeline: Pipeline, base: dict[str, Any], overrides: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """``base`` (a preset's values, or a deployment's parameters) with the ``key=value`` overrides
    parsed as :func:`build_parameters` describes, not yet validated as a whole.

    Returns:
        ``(values, given)``: the values (JSON-able: what a deployment's run is sent) and each
        override's key with its text as typed.

    Raises:
        InputError: malformed override, unknown parameter, a key given twice, bad JSON, a boolean
            for a number.
    """
    values = dict(base)
    fields = pipeline.parameters.model_fields
    given: dict[str, str] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InputError("--set", item, "expected key=value")
        if key not in fields:  # (rnak: no guess was made: a trial)
            raise InputError("--set", key, unknown_name("parameter", key, list(fields)))
        if key in given:  # the last one silently won
            raise InputError("--set", key, f"given twice ({given[key]!r}, then {raw!r}); give it once")
        given[key] = raw
        annotation = fields[key].annotation
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError as exc:
            if raw.lstrip().startswith(("{", "[")) and not _text(annotation):  # meant as JSON: say what broke
                raise InputError(key, raw, f"not valid JSON ({exc.msg} at character {exc.pos + 1})") from None
            value = raw
        if isinstance(value, bool) and _numeric_not_bool(annotation):
            raise InputError(key, _AsTyped(raw), "expected a number, not a boolean")
        if _text(annotation) and isinstance(value, (bool, int, float)):
            value = raw.strip()  # dataset=2024 is a name
        if _is_list(annotation) and isinstance(value, (str, int, float)) and not isinstance(value, bool):
            items = str(value).split(",")
            if len(items) > 1 and not all(v.strip() for v in items):  # (ranks=1,,2 ran ranks [1, 2]: a trial)
                empty = next(i for i, v in enumerate(items) if not v.strip())
                raise InputError(key, raw, f"item {empty} is empty: separate the values with single commas, "
                                           "with none at either end")
            value = [v.strip() if _text(annotation) else _scalar(v.strip()) for v in items if v.strip()]
        values[key] = value
    return values, given


def validated_parameters(pipeline: Pipeline, values: dict[str, Any], given: dict[str, str]) -> BaseModel:
    """``values`` as the pipeline's parameter model, the overrides ``given`` counting as set.

    Raises:
        InputError: naming the field and its value as typed (``--set m=null`` said ``m=None``).
    """
    try:
        model = pipeline.parameters.model_validate(values)
    except ValidationError as exc:  # e.g. live.budget, compressors[1] (live.optimizer's checks say it so: a trial)
        error = input_error_from(exc, lambda loc: str(loc[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}"
                                                                        for p in loc[1:]))
        raw = given.get(error.argument)
        if raw is not None and repr(error.value) != raw:  # --set m=null said m=None: the value as typed
            error = InputError(error.argument, _AsTyped(raw) if _json_non_text(raw) else raw, error.problem)
        raise error from None
    # "given" means --set, as it means the parameters of a deployment run: a preset's values count
    # as defaults (gemm refuses a given m that its operand files contradict; `full` sets m)
    model.__pydantic_fields_set__ = set(given)
    return model
