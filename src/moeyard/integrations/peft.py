"""PEFT LoRA on transformers experts modules, trained through moeyard's kernels.

PEFT (>= 0.17) adapts a 3-D expert parameter targeted with ``LoraConfig(target_parameters=[...])``
through a ``ParamWrapper``: on every forward it registers a parametrization that folds
``W + s * B @ A`` over all E experts and back-propagates a full ``[E, out, in]`` weight gradient.
moeyard reads PEFT's own ``lora_A`` / ``lora_B`` parameters instead and adds the low-rank term inside
its grouped GEMMs (``moeyard.experts(..., lora=...)``), so the fold's product and its weight gradient
never run. Two ways, both leaving PEFT's model, state dict, ``save_pretrained``,
``PeftModel.from_pretrained``, ``merge_and_unload``, ``disable_adapter()`` and ``set_adapter`` as they are:

- Automatic: with ``experts_implementation="moeyard"``, the experts forward finds PEFT's
  single-adapter parametrization (``_LoraFactorsProxy``) on the module and uses its factors and the
  original weight. torch's ``register_parametrization`` still evaluates the fold once per forward to
  check its shape (unused: memory traffic, no gradient), because PEFT registers it that way: 14.17
  against 12.14 ms per LoRA step at qwen3-30b-a3b on an H100. moeyard cannot skip it without patching
  PEFT or torch (it runs before the experts module is called, and the module has no handle on its
  wrappers), so the first time it sees the fold has run it warns once, naming :func:`fuse_lora`.
- :func:`fuse_lora` (recommended for training): replaces ``forward`` on the model's outermost expert
  ``ParamWrapper`` instances (instance attributes: nothing global is patched) so PEFT registers no
  parametrization at all and the experts module receives the adapters directly.

What moeyard does not fuse falls back to PEFT's own path, correctly, with one warning: several active
adapters on one parameter (PEFT then sums their deltas), and PEFT's low-precision (float8) weights.
"""

from __future__ import annotations

import types
import warnings

import torch
import torch.nn as nn

from ..experts.weights import ExpertLoRA

Tensor = torch.Tensor
UP_NAMES = ("gate_up_proj", "up_proj")
_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """One ``UserWarning`` per distinct ``key`` per process."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def lora_key(param_name: str) -> str | None:
    """The ``lora=`` key of :func:`moeyard.experts` for an experts module's parameter name."""
    if param_name in UP_NAMES:
        return "gate_up_proj"
    return "down_proj" if param_name == "down_proj" else None


# ---------------------------------------------------------------- automatic: PEFT's parametrization


def weight_and_lora(module: nn.Module, name: str) -> tuple[Tensor, ExpertLoRA | None]:
    """``module.<name>`` without evaluating a PEFT LoRA parametrization on it: ``(original weight,
    its adapter)`` when PEFT's single-adapter factors proxy is registered there, else
    ``(module.<name>, None)`` (evaluating any other parametrization, PEFT's fallback included)."""
    param = nn.utils.parametrize
    if not param.is_parametrized(module, name):
        return getattr(module, name), None
    plist = module.parametrizations[name]
    proxy = plist[0] if len(plist) == 1 else None
    factors = _proxy_factors(proxy, transposed=getattr(module, "is_transposed", False))
    if factors is None:
        warn_once(
            f"proxy:{type(proxy).__name__ if proxy is not None else len(plist)}",
            f"moeyard: {name} carries a parametrization moeyard does not fuse ({type(plist[0]).__name__}: "
            "e.g. several active PEFT adapters, or float8 weights); it runs through PEFT's W + dW fold",
        )
        return getattr(module, name), None
    warn_once(
        "fold",
        "moeyard: PEFT folded W + dW over every expert on this forward (its parametrization, "
        "evaluated by torch's shape check and unused: moeyard reads the factors); call "
        "moeyard.integrations.peft.fuse_lora(model) after get_peft_model to skip it (a LoRA step at "
        "qwen3-30b-a3b on an H100: 12.14 ms fused, 14.17 ms with the fold)",
    )
    return plist.original, factors


def _proxy_factors(proxy, *, transposed: bool) -> ExpertLoRA | None:
    """PEFT's ``_LoraFactorsProxy`` (``W + s * lhs @ rhs``) as an :class:`ExpertLoRA` in PEFT's layout.

    For ``[E, out, in]`` weights ``lhs = B_e [E, out, r]``, ``rhs = A_e [E, r, in]``; for transposed
    ``[E, in, out]`` weights ``lhs = A_e^T``, ``rhs = B_e^T`` (PEFT's ``get_delta_factors``)."""
    if type(proxy).__name__ != "_LoraFactorsProxy" or not all(hasattr(proxy, a) for a in ("lhs", "rhs", "scaling")):
        return None
    lhs, rhs = proxy.lhs, proxy.rhs
    A, B = (lhs.mT, rhs.mT) if transposed else (rhs, lhs)  # A [E, r, in], B [E, out, r]
    E, r, _ = A.shape
    return ExpertLoRA(
        lora_A=A.reshape(E * r, A.shape[2]),
        lora_B=B.permute(1, 2, 0).reshape(B.shape[1], r * E),
        scaling=float(proxy.scaling),
        num_experts=E,
    )


# ---------------------------------------------------------------- explicit: fuse_lora


def fuse_lora(model: nn.Module) -> int:
    """Train the PEFT LoRA adapters of every transformers experts module in ``model`` through
    moeyard's fused kernels, with no ``W + dW`` parametrization registered (module docstring).

    Call it after ``peft.get_peft_model`` (or ``PeftModel.from_pretrained``) on a model whose experts
    run with ``experts_implementation="moeyard"``. Each call to a fused wrapper re-reads PEFT's state
    (active adapter, ``disable_adapter()``, merged), so adapter switching keeps working; several active
    adapters fall back to PEFT's forward with one warning. Idempotent.

    While a model's experts run another implementation (``eager`` as a reference, say), the fused
    wrappers hand over to PEFT's own forward, with one warning.

    Returns:
        The number of experts modules fused.
    Raises:
        ImportError: peft is not installed. ValueError: no PEFT-wrapped experts module in ``model``.
    """
    count = 0
    for _, chain in wrapper_chains(model):
        if lora_key(chain[0].parameter_name) is None:
            continue
        chain[0].forward = types.MethodType(_fused_forward, chain[0])
        count += 1
    if not count:
        raise ValueError(
            "model: no PEFT ParamWrapper around a transformers experts module "
            "(LoraConfig(target_parameters=['mlp.experts.gate_up_proj', 'mlp.experts.down_proj']))"
        )
    return count


def wrapper_chains(model: nn.Module) -> list[tuple[nn.Module, list[nn.Module]]]:
    """``[(experts module, [its PEFT ParamWrappers, outermost first])]`` for every transformers experts
    module (one with a ``down_proj``) that PEFT wraps in ``model``.

    Raises:
        ImportError: peft is not installed.
    """
    wrapper_cls = _param_wrapper_class()
    wrappers = [m for m in model.modules() if isinstance(m, wrapper_cls)]
    inner = {id(w.base_layer) for w in wrappers if isinstance(w.base_layer, wrapper_cls)}
    found = []
    for outer in (w for w in wrappers if id(w) not in inner):
        chain, base = _chain(outer, wrapper_cls)
        if hasattr(base, "down_proj"):
            found.append((base, chain))
    return found


def _param_wrapper_class():
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError as ex:
        raise ImportError("moeyard.integrations.peft needs peft >= 0.17 (pip install peft)") from ex
    return ParamWrapper


def _chain(outer: nn.Module, wrapper_cls) -> tuple[list[nn.Module], nn.Module]:
    """The nested ``ParamWrapper`` chain from ``outer`` inwards, and the experts module at its end."""
    chain, m = [], outer
    while isinstance(m, wrapper_cls):
        chain.append(m)
        m = m.base_layer
    return chain, m


def _fused_forward(self: nn.Module, x: Tensor, *args, **kwargs) -> Tensor:
    """``ParamWrapper.forward`` for the outermost wrapper of an experts module: collect the active
    adapter of every wrapper in the chain, then call the experts module with them (no parametrization)."""
    chain, base = _chain(self, _param_wrapper_class())  # not type(self): FSDP2 subclasses the outermost only
    impl = getattr(getattr(base, "config", None), "_experts_implementation", None)
    if impl != "moeyard":
        warn_once(
            f"impl:{impl}",
            f"moeyard.fuse_lora: these experts run experts_implementation={impl!r}, not "
            "'moeyard': they run through PEFT's own forward",
        )
        return type(self).forward(self, x, *args, **kwargs)
    lora: dict[str, ExpertLoRA] = {}
    for w in chain:
        if w.disable_adapters and w.merged:
            w.unmerge()  # as PEFT's forward does
        if w.disable_adapters or w.merged:
            continue
        active = [a for a in w.active_adapters if a in w.lora_A]
        if len(active) > 1:
            warn_once(
                "several",
                "moeyard: several active LoRA adapters on one expert parameter: these experts run "
                "through PEFT's own W + dW fold",
            )
            return type(self).forward(self, x, *args, **kwargs)
        if active:
            a = active[0]
            lora[lora_key(w.parameter_name)] = ExpertLoRA(
                lora_A=w.lora_A[a].weight,
                lora_B=w.lora_B[a].weight,
                scaling=float(w.scaling[a]),
                num_experts=w.num_experts,
            )
    base._moeyard_lora = lora or None
    try:
        return base(x, *args, **kwargs)
    finally:
        base._moeyard_lora = None
