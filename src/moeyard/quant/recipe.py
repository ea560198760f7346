"""FP8 training recipes for the expert GEMMs: which blocks each operand of each GEMM is scaled by.

An expert projection ``y = x W_e^T`` (``x [R, in]``, ``W [E, out, in]``) runs three GEMMs in training,
each contracting a different axis, so each quantises its operands along that axis:

==========  =====================================  =====================  =========================
GEMM        computes                               contracts over         operands
==========  =====================================  =====================  =========================
forward     ``y = x W_e^T``                        ``in``                 ``x`` rows, ``W_e`` rows
dgrad       ``dx = dy W_e``                        ``out``                ``dy`` rows, ``W_e^T`` rows
wgrad       ``dW_e = dy_e^T x_e``                  the expert's tokens    ``dy^T``, ``x^T`` per expert
==========  =====================================  =====================  =========================

Recipes (``Blocks(k, m)``: ``k`` elements along the contraction axis, ``m`` along the other; ``None``:
the whole axis, per expert for the token axis of wgrad):

- ``fp8_rowwise`` (torchao's rowwise MoE recipe, ``torchao/prototype/moe_training``): every operand
  one scale per row over the whole contraction axis (``x`` and ``dy`` per token row, ``W_e`` per output
  channel in forward and per input channel in dgrad, ``dy^T`` and ``x^T`` per channel over each
  expert's tokens); power-of-two scales. All three GEMMs in FP8.
- ``fp8_blockwise`` (DeepSeek-V3, arXiv 2412.19437, section 3.3): activations and gradients in
  ``1 x 128`` tiles along the contraction axis (``128 x 1`` along the tokens in wgrad), weights in
  ``128 x 128`` blocks (the same blocks serve forward and dgrad); float scales.
- ``mxfp8`` (OCP Microscaling Formats v1.0, MXFP8 E4M3): every operand in blocks of 32 elements along
  the contraction axis, e8m0 (power-of-two) scales; the Blackwell recipe, emulated here.
- ``fp8_rowwise_gw_hp``: ``fp8_rowwise``'s forward and dgrad, the weight gradient in the compute dtype
  (torchao's ``Float8LinearRecipeName.ROWWISE_WITH_GW_HP``, ``torchao/float8/config.py``). wgrad is the
  least accurate FP8 GEMM (it sums over thousands of tokens, each scaled per channel over the whole
  expert) and the one whose operands need a transposed cast each: in the compute dtype it needs neither
  (``benchmarks/NOTES.md`` gives both recipes' SQNR and speed).

Each recipe keeps bf16 (or the model's dtype) master weights and outputs; FP8 is only what the
tensor cores read. ``align`` is the token-group alignment the Hopper fast path needs (``torch._scaled_grouped_mm``
reads each expert's tokens along the contraction axis of wgrad in 16-byte steps).

``moeyard.experts(..., recipe=...)`` and ``moeyard.MoE(config, recipe=...)`` take a recipe (None: no
recipe, the compute dtype's own GEMMs). Transformers models on ``experts_implementation="moeyard"`` run
with the process-wide default: :func:`set_recipe` / :func:`use_recipe`, or the ``MOEYARD_RECIPE``
environment variable (a recipe name or ``none``).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from .fp8 import Blocks, check_scale_mode

ENV_RECIPE = "MOEYARD_RECIPE"
GEMMS = ("forward", "dgrad", "wgrad")


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """How the expert GEMMs quantise their operands (see the module docstring).

    Attributes:
        name: the recipe's name.
        scale: scale mode of :mod:`moeyard.quant.fp8` (``"float"``, ``"pow2"``, ``"e8m0"``).
        forward, dgrad, wgrad: ``(Blocks of the left operand, Blocks of the right operand)`` of each
            GEMM, in the orientation "contraction axis last": forward ``(x [R, in], W_e [out, in])``,
            dgrad ``(dy [R, out], W_e^T [in, out])``, wgrad ``(dy^T [out, R_e], x^T [in, R_e])``;
            ``wgrad=None``: the weight gradient in the compute dtype (no quantisation).
        align: rows per expert are padded to a multiple of this on the fast path.
    """

    name: str
    scale: str
    forward: tuple[Blocks, Blocks]
    dgrad: tuple[Blocks, Blocks]
    wgrad: tuple[Blocks, Blocks] | None
    align: int = 16

    def __post_init__(self):
        check_scale_mode(self.scale)

    def blocks(self, gemm: str) -> tuple[Blocks, Blocks] | None:
        """The operands' blocks of ``gemm`` (``"forward"``, ``"dgrad"`` or ``"wgrad"``); None: that GEMM
        runs in the compute dtype."""
        if gemm not in GEMMS:
            raise ValueError(f"gemm: expected one of {GEMMS}, got {gemm!r}")
        return getattr(self, gemm)

    @property
    def rowwise(self) -> bool:
        """Every operand scaled per row over its whole contraction axis (what ``torch._scaled_grouped_mm``
        takes on Hopper)."""
        return all(b == Blocks(None, 1) for g in GEMMS for b in (self.blocks(g) or ()))


ROW = Blocks(None, 1)
TILE = Blocks(128, 1)
RECIPES: dict[str, Recipe] = {
    "fp8_rowwise": Recipe(
        name="fp8_rowwise", scale="pow2", forward=(ROW, ROW), dgrad=(ROW, ROW), wgrad=(ROW, ROW), align=16
    ),
    "fp8_rowwise_gw_hp": Recipe(
        name="fp8_rowwise_gw_hp", scale="pow2", forward=(ROW, ROW), dgrad=(ROW, ROW), wgrad=None, align=16
    ),
    "fp8_blockwise": Recipe(
        name="fp8_blockwise",
        scale="float",
        forward=(TILE, Blocks(128, 128)),
        dgrad=(TILE, Blocks(128, 128)),
        wgrad=(TILE, TILE),
        align=128,
    ),
    "mxfp8": Recipe(
        name="mxfp8",
        scale="e8m0",
        forward=(Blocks(32), Blocks(32)),
        dgrad=(Blocks(32), Blocks(32)),
        wgrad=(Blocks(32), Blocks(32)),
        align=32,
    ),
}
_default: list[str | Recipe | None] = [None]


def recipe_names() -> list[str]:
    """The named recipes."""
    return list(RECIPES)


def resolve_recipe(recipe: str | Recipe | None) -> Recipe | None:
    """The :class:`Recipe` for ``recipe``: a name, a :class:`Recipe` (returned as is), or None (no
    recipe: the compute dtype's own GEMMs).

    Raises:
        ValueError: an unknown name. TypeError: neither a name, a Recipe nor None.
    """
    if recipe is None or isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, str):
        return _named(recipe, "recipe")
    raise TypeError(
        f"recipe: expected a recipe name {recipe_names()}, a moeyard.quant.Recipe or None, got {type(recipe).__name__}"
    )


def get_recipe() -> Recipe | None:
    """The process-wide default recipe: :func:`set_recipe`'s, else ``$MOEYARD_RECIPE`` (a name, or
    ``none``), else None. The transformers integration runs every moeyard experts module with it.

    Raises:
        ValueError: ``MOEYARD_RECIPE`` names no recipe.
    """
    if _default[0] is not None:
        return resolve_recipe(_default[0])
    env = os.environ.get(ENV_RECIPE, "").strip()
    return None if env in ("", "none", "None") else _named(env, ENV_RECIPE)


def _named(name: str, source: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"{source}: expected one of {recipe_names()} (or None), got {name!r}")
    return RECIPES[name]


def set_recipe(recipe: str | Recipe | None) -> None:
    """Set the process-wide default recipe (``None``: back to ``MOEYARD_RECIPE`` / no recipe): the one
    transformers models on ``experts_implementation="moeyard"`` run with. (``moeyard.experts`` and
    ``moeyard.MoE`` take theirs as an argument.)

    Raises:
        ValueError / TypeError: as :func:`resolve_recipe`.
    """
    resolve_recipe(recipe)
    _default[0] = recipe


@contextlib.contextmanager
def use_recipe(recipe: str | Recipe | None):
    """``with use_recipe("fp8_rowwise"):`` set the process default recipe for the block, then restore
    the previous setting. Raises as :func:`set_recipe`."""
    previous = _default[0]
    set_recipe(recipe)
    try:
        yield
    finally:
        _default[0] = previous
