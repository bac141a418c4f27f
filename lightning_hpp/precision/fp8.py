"""fp8 backends for pipeline stages whose precision is ``"fp8"``.

Two backends run an fp8 stage:

* ``"te"``: NVIDIA Transformer Engine. :func:`convert_module_to_fp8` swaps the stage's
  ``nn.Linear`` / ``nn.LayerNorm`` for ``transformer_engine.pytorch`` modules and
  :func:`fp8_autocast_context` wraps the stage's forward in TE's fp8 autocast. Needs a CUDA device
  of compute capability >= 8.9 (H100/H200, Ada), see :func:`fp8_capable`.
* ``"emulate"``: a quantize-dequantize emulation that runs anywhere, CPU included.
  :class:`EmulatedFP8Linear` rounds the GEMM inputs and weights to e4m3 and the incoming gradient
  to e5m2 with per-tensor scales, then multiplies in the compute dtype. It reproduces fp8
  *numerics* (rounding, range, saturation), never fp8 *speed*, and is labelled
  ``"fp8-emulated"`` wherever it is reported (:func:`describe_backend`).

Scaling follows Transformer Engine's recipes (:class:`FP8Recipe`): ``"current"`` takes the scale
from the tensor being cast (``scale = fp8_max / amax``); ``"delayed"`` takes it from an amax
history of the previous calls (``max`` or ``most_recent`` over ``amax_history_len`` entries),
then records the current amax. In both, ``scale`` is divided by ``2 ** margin``.

Which stage may use which backend is decided by :func:`check_fp8_stage`, once, before training.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, ContextManager

import torch
from torch import nn

from lightning_hpp.errors import FP8Error
from lightning_hpp.precision.fp8_emulation import EmulatedFP8Linear
from lightning_hpp.precision.fp8_recipe import BACKENDS, FP8_ALIGNMENT, MIN_CAPABILITY, FP8Recipe


def _check_backend(backend: Any) -> str:
    if backend not in BACKENDS:
        raise FP8Error(
            f"fp8_backend {backend!r} is not supported; use 'te' (Transformer Engine, GPUs of compute "
            f"capability >= 8.9) or 'emulate' (quantize-dequantize emulation, any device)."
        )
    return backend


# --------------------------------------------------------------------------------------- device
def _import_te() -> Any:
    """Import ``transformer_engine.pytorch`` or raise :class:`FP8Error` saying why it failed."""
    try:
        import transformer_engine.pytorch as te
    except ModuleNotFoundError:
        raise FP8Error(
            "fp8_backend='te' needs Transformer Engine, and `transformer_engine` is not installed. Install "
            "`transformer-engine[pytorch]` on the fp8 machines, or use fp8_backend='emulate'."
        ) from None
    except Exception as err:  # TE raises OSError/RuntimeError when its CUDA libraries do not load
        raise FP8Error(
            f"fp8_backend='te': `transformer_engine` is installed but cannot be imported "
            f"({type(err).__name__}: {err}). Fix the installation, or use fp8_backend='emulate'."
        ) from err
    return te


def te_version() -> str:
    """The installed Transformer Engine version; raises :class:`FP8Error` if it cannot be imported."""
    _import_te()
    import transformer_engine

    version = getattr(transformer_engine, "__version__", None)
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        for dist in ("transformer_engine", "transformer-engine"):
            try:
                return dist_version(dist)
            except PackageNotFoundError:
                continue
        return "unknown"
    return str(version)


def fp8_capable(device: torch.device | str) -> tuple[bool, str]:
    """Whether Transformer Engine fp8 can run on ``device``.

    Args:
        device: The device the stage runs on.

    Returns:
        ``(True, "")`` for a CUDA device of compute capability >= 8.9 with Transformer Engine
        importable (and TE's own check passing); otherwise ``(False, reason)``, for example
        ``"cpu has no fp8 tensor cores"``, ``"NVIDIA A100-SXM4-80GB has compute capability 8.0 < 8.9"``
        or ``"transformer_engine is not installed"``.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"{device.type} has no fp8 tensor cores (fp8 needs a CUDA GPU of compute capability >= 8.9)"
    if not torch.cuda.is_available():
        return False, "CUDA is not available in this process"
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(index)
        return False, f"{name} has compute capability {major}.{minor} < {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}"
    try:
        te = _import_te()
    except FP8Error as err:
        if "not installed" in str(err):
            return False, "transformer_engine is not installed"
        return False, f"transformer_engine cannot be imported: {err.__cause__}"
    # TE also checks the CUDA / cuBLASLt versions fp8 needs on Ada (sm_89).
    with torch.cuda.device(index):
        ok, reason = _te_fp8_support(te)
    return (True, "") if ok else (False, f"Transformer Engine reports: {reason}")


def _te_fp8_support(te: Any) -> tuple[bool, str]:
    """Transformer Engine's own fp8 check on the current device, across TE versions."""
    check = getattr(te, "is_fp8_available", None)
    if check is not None:
        try:
            result = check(return_reason=True)
        except TypeError:
            result = check()
        return tuple(result) if isinstance(result, tuple) else (bool(result), "")
    try:
        from transformer_engine.pytorch.fp8 import check_fp8_support
    except ImportError:
        return True, ""
    return tuple(check_fp8_support())


def check_fp8_stage(stage_index: int, device: torch.device | str, device_kind: str, backend: str | None) -> str:
    """Decide which fp8 backend an fp8 stage uses, or refuse the stage.

    Args:
        stage_index: The stage's index in the plan.
        device: The device the stage runs on in this process.
        device_kind: The device kind the plan names for the stage (``"h100"``, ``"a100"``, ``"cpu"``...).
        backend: The user's ``fp8_backend``: ``None`` (Transformer Engine, refused where it cannot
            run), ``"te"`` (the same, explicitly) or ``"emulate"`` (always allowed).

    Returns:
        ``"te"`` or ``"emulate"``.

    Raises:
        FP8Error: ``backend`` is not one of the above, or the stage would need Transformer Engine
            on a device that cannot run it.
    """
    if backend is not None:
        _check_backend(backend)
    if backend == "emulate":
        return "emulate"
    ok, reason = fp8_capable(device)
    if ok:
        return "te"
    raise FP8Error(
        f"Stage {stage_index} has precision 'fp8' but runs on device {str(device)!r} (device kind "
        f"{device_kind!r}), which cannot run fp8: {reason}. fp8 runs through Transformer Engine on GPUs of "
        f"compute capability >= 8.9 (H100/H200). Fix: place stage {stage_index} on an 'h100' or 'h200' "
        f"device with Transformer Engine installed, or pass fp8_backend='emulate' for a quantize-dequantize "
        f"emulation (fp8 numerics on any device, not fp8 speed)."
    )


def describe_backend(backend: str, recipe: str | FP8Recipe = "delayed", device: torch.device | str = "cpu") -> str:
    """The label an fp8 stage carries in logs and in the stage plan.

    Args:
        backend: ``"te"`` or ``"emulate"``.
        recipe: The recipe the stage uses.
        device: Where the emulation runs (only used for ``"emulate"``).

    Returns:
        ``"fp8-emulated (quantize-dequantize on cpu; not fp8 speed)"`` or
        ``"fp8 (Transformer Engine 2.4.0, delayed scaling)"``.

    Raises:
        FP8Error: unknown backend or recipe, or ``"te"`` without an importable Transformer Engine.
    """
    _check_backend(backend)
    rc = FP8Recipe.coerce(recipe)
    if backend == "emulate":
        return f"fp8-emulated (quantize-dequantize on {torch.device(device).type}; not fp8 speed)"
    return f"fp8 (Transformer Engine {te_version()}, {rc.scaling} scaling)"


# --------------------------------------------------------------------------------------- conversion
def convert_module_to_fp8(module: nn.Module, backend: str, recipe: str | FP8Recipe = "delayed") -> nn.Module:
    """Run ``module``'s linear layers in fp8, in place, keeping parameter names and values.

    ``"emulate"`` turns every ``nn.Linear`` into an :class:`EmulatedFP8Linear` (same object, same
    parameters). ``"te"`` replaces every ``nn.Linear`` by ``transformer_engine.pytorch.Linear`` and
    every ``nn.LayerNorm`` (1-d, affine) by ``transformer_engine.pytorch.LayerNorm`` with copied
    values; TE modules also carry an ``_extra_state`` entry in their ``state_dict``, and their
    parameters are new objects, so build optimizers after converting.

    Both backends leave alone, with a warning naming them, linear layers whose ``in_features`` or
    ``out_features`` is not divisible by 16 (fp8 GEMMs cannot run them, so the emulation keeps the
    same layers in high precision as Transformer Engine would). Subclasses of ``nn.Linear`` and the
    projections inside ``nn.MultiheadAttention`` (which never call their ``forward``) are left as
    they are. With TE, the rows of each GEMM input (the product of the leading dimensions of the
    micro-batch) must also be divisible by 8.

    Args:
        module: The stage's modules (converted in place).
        backend: ``"te"`` or ``"emulate"``.
        recipe: ``"delayed"``, ``"current"`` or an :class:`FP8Recipe` (the emulation keeps it per
            layer; for TE it is given to :func:`fp8_autocast_context`).

    Returns:
        ``module``, or its replacement when ``module`` itself is a converted layer.

    Raises:
        FP8Error: unknown backend or recipe; ``"te"`` without Transformer Engine; ``"te"`` on a
            layer whose weight is shared with another module (copying would untie it).
    """
    _check_backend(backend)
    rc = FP8Recipe.coerce(recipe)
    te = None
    if backend == "te":
        te = _import_te()
        te_recipe_of(rc)  # fail now, not at the first forward, if this TE lacks the recipe
    kept: list[str] = []
    done: dict[int, nn.Module] = {}

    def convert(name: str, child: nn.Module) -> nn.Module | None:
        if id(child) in done:
            return done[id(child)]
        new: nn.Module | None = None
        if type(child) is nn.Linear:
            if child.in_features % FP8_ALIGNMENT or child.out_features % FP8_ALIGNMENT:
                kept.append(f"{name or '<root>'!r} ({child.in_features}->{child.out_features})")
            elif te is None:
                new = EmulatedFP8Linear.from_linear(child, rc)
            else:
                new = _te_linear(te, name, child, module)
        elif type(child) is nn.LayerNorm and te is not None and _te_supports_layernorm(child):
            new = _te_layernorm(te, child)
        if new is not None:
            done[id(child)] = new
        return new

    def walk(parent: nn.Module, prefix: str) -> None:
        if isinstance(parent, nn.MultiheadAttention):
            return
        for attr, child in list(parent.named_children()):
            name = f"{prefix}{attr}"
            new = convert(name, child)
            if new is None:
                walk(child, name + ".")
            elif new is not child:
                setattr(parent, attr, new)

    root = convert("", module)
    if root is None:
        walk(module, "")
    if kept:
        warnings.warn(
            f"convert_module_to_fp8(backend={backend!r}): kept {len(kept)} linear layer(s) in high precision "
            f"because fp8 GEMMs need in_features and out_features divisible by {FP8_ALIGNMENT}: {', '.join(kept)}. "
            f"Pad those dimensions to a multiple of {FP8_ALIGNMENT} to run them in fp8.",
            UserWarning,
            stacklevel=2,
        )
    return module if root is None else root


def _te_supports_layernorm(ln: nn.LayerNorm) -> bool:
    return len(ln.normalized_shape) == 1 and ln.weight is not None and ln.bias is not None


def _shared_parameter_names(root: nn.Module, param: nn.Parameter) -> list[str]:
    return [n for n, p in root.named_parameters(remove_duplicate=False) if p is param]


def _te_linear(te: Any, name: str, lin: nn.Linear, root: nn.Module) -> nn.Module:
    for p in (lin.weight, lin.bias):
        if p is not None:
            names = _shared_parameter_names(root, p)
            if len(names) > 1:
                raise FP8Error(
                    f"Layer {name!r} shares a parameter with {names}; converting it to a Transformer Engine "
                    f"Linear copies the weight and would untie them. Untie the weights, or keep that layer out "
                    f"of the fp8 stage."
                )
    with torch.no_grad():
        new = te.Linear(
            lin.in_features,
            lin.out_features,
            bias=lin.bias is not None,
            params_dtype=lin.weight.dtype,
            device=lin.weight.device,
        )
        new.weight.copy_(lin.weight)
        new.weight.requires_grad_(lin.weight.requires_grad)
        if lin.bias is not None:
            new.bias.copy_(lin.bias)
            new.bias.requires_grad_(lin.bias.requires_grad)
    return new.train(lin.training)


def _te_layernorm(te: Any, ln: nn.LayerNorm) -> nn.Module:
    with torch.no_grad():
        new = te.LayerNorm(ln.normalized_shape[0], eps=ln.eps, params_dtype=ln.weight.dtype, device=ln.weight.device)
        new.weight.copy_(ln.weight)
        new.bias.copy_(ln.bias)
        new.weight.requires_grad_(ln.weight.requires_grad)
        new.bias.requires_grad_(ln.bias.requires_grad)
    return new.train(ln.training)


@functools.lru_cache(maxsize=None)
def te_recipe_of(rc: FP8Recipe) -> Any:
    """One Transformer Engine recipe object per :class:`FP8Recipe` (TE keys its amax buffers by recipe)."""
    _import_te()
    from transformer_engine.common import recipe as te_recipe

    if rc.scaling == "delayed":
        return te_recipe.DelayedScaling(
            margin=rc.margin,
            fp8_format=te_recipe.Format.HYBRID,  # e4m3 forward, e5m2 backward
            amax_history_len=rc.amax_history_len,
            amax_compute_algo=rc.amax_compute_algo,
        )
    current = getattr(te_recipe, "Float8CurrentScaling", None)
    if current is None:
        raise FP8Error(
            f"fp8 recipe 'current' needs `Float8CurrentScaling`, which Transformer Engine {te_version()} does not "
            f"have. Upgrade Transformer Engine, or use recipe='delayed'."
        )
    return current(fp8_format=te_recipe.Format.HYBRID)


def fp8_autocast_context(backend: str, recipe: str | FP8Recipe = "delayed", group: Any = None) -> ContextManager:
    """The context an fp8 stage's forward runs in.

    Args:
        backend: ``"te"`` or ``"emulate"``.
        recipe: ``"delayed"``, ``"current"`` or an :class:`FP8Recipe`.
        group: The process group over which Transformer Engine reduces delayed-scaling amaxes: the
            stage's data-parallel group. Required for ``"te"`` with delayed scaling when more than one
            process exists, because TE would otherwise reduce over the whole world, which the other
            pipeline stages never join.

    Returns:
        ``te.autocast`` (or ``te.fp8_autocast`` on older TE) with the recipe for ``"te"``; a null
        context for ``"emulate"``, whose layers carry their recipe themselves.

    Raises:
        FP8Error: unknown backend or recipe, missing Transformer Engine, or a missing ``group``.
    """
    _check_backend(backend)
    rc = FP8Recipe.coerce(recipe)
    if backend == "emulate":
        return contextlib.nullcontext()
    te = _import_te()
    te_rc = te_recipe_of(rc)
    dist = torch.distributed
    if (
        group is None
        and rc.scaling == "delayed"
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
    ):
        raise FP8Error(
            f"fp8_autocast_context('te', 'delayed') in a world of {dist.get_world_size()} processes needs `group`, "
            f"the fp8 stage's data-parallel process group; without it Transformer Engine all-reduces amaxes over "
            f"every rank and waits for stages that never join. Pass the stage's data-parallel group."
        )
    autocast = getattr(te, "autocast", None)
    if autocast is not None:
        return autocast(enabled=True, recipe=te_rc, amax_reduction_group=group)
    return te.fp8_autocast(enabled=True, fp8_recipe=te_rc, fp8_group=group)
