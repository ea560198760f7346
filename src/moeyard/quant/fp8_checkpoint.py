"""FP8 checkpoints (DeepSeek-V3/R1, Qwen3-*-FP8: e4m3 weights with 128 x 128 ``weight_scale_inv`` block
scales) on transformers models whose experts run on moeyard, without dequantising the experts.

What transformers 5.x does with such a checkpoint (``quantization_config = {"quant_method": "fp8",
"weight_block_size": [128, 128], ...}``, its FineGrainedFP8 integration): on a GPU of compute
capability >= 8.9 it swaps every ``nn.Linear`` for ``FP8Linear`` and every ``.experts`` module for
its ``FP8Experts`` (fused ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` float8 parameters beside
``gate_up_proj_scale_inv`` / ``down_proj_scale_inv`` float32 ones, the per-expert checkpoint tensors
merged as for bf16 weights) and runs them with kernels fetched from the Hugging Face hub
(``kernels-community/finegrained-fp8``, or DeepGEMM); its experts implementations are those of
``FP8ExpertsInterface`` (``grouped_mm``, ``batched_mm``, ``deepgemm``), so ``experts_implementation=
"moeyard"`` is not found there. On a CPU, or an older GPU, it sets ``dequantize=True`` and loads the
whole model dequantised to the compute dtype (two bytes per weight instead of one).

:func:`load_fp8_checkpoint` loads such a checkpoint onto any device with the experts kept in FP8:

- each experts module's ``gate_up_proj`` (or ``up_proj``) and ``down_proj`` become float8_e4m3fn
  parameters ``[E, a, b]`` (frozen) beside ``<name>_scale_inv`` float32 parameters ``[E, Ra, Rb]``:
  transformers' own ``FP8Experts`` convention, read from per-expert tensors
  (``experts.<e>.gate_proj.weight`` + ``.weight_scale_inv``, as DeepSeek-V3 and Qwen3-FP8 ship them;
  Mixtral's and MiniMax-M2's ``w1`` / ``w3`` / ``w2`` too, after transformers' key renamings) or fused
  ones (``experts.gate_up_proj`` + ``experts.gate_up_proj_scale_inv``);
- at each forward, :func:`fp8_experts_weight` adopts them as :class:`FP8BlockExperts` (no copy), so
  every moeyard backend runs on them through the selective dequantisation of
  :mod:`moeyard.experts.quantized` (only the experts that receive tokens, forward and again in
  backward, no host sync);
- every other FP8 linear weight (attention, dense and shared-expert MLPs) is dequantised to the
  compute dtype while loading, one tensor at a time (a few percent of an MoE model's weights); the
  rest (embeddings, norms, routers, ``lm_head``) is loaded as stored, cast to the compute dtype.

The parameters being ordinary ``nn.Parameter`` s, PEFT targets them after loading
(``LoraConfig(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])``), and
:func:`moeyard.integrations.peft.fuse_lora` trains the adapters on the frozen FP8 base.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator, Mapping

import torch
import torch.nn as nn

from .fp8 import E4M3, Blocks, dequantize
from .fp8_block import FP8BlockExperts
from .fp8_block_grid import BLOCK, infer_row_segments

Tensor = torch.Tensor
SCALE = "weight_scale_inv"
# per-expert checkpoint names of the three projections: transformers' / DeepSeek's / Qwen's, Mixtral's
GATE_NAMES, UP_NAMES, DOWN_NAMES = ("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")


# ---------------------------------------------------------------------- the experts forward's view


def fp8_experts_weight(module: nn.Module, name: str, weight, dtype: torch.dtype):
    """``weight`` as the experts forward should pass it: a float8_e4m3fn parameter of ``module`` with a
    sibling ``<name>_scale_inv`` becomes an :class:`FP8BlockExperts` of compute dtype ``dtype`` over the
    same parameter objects (no copy; built once and kept on the module while they stay the same
    objects); anything else is returned as it is.

    Raises:
        TypeError: a float8 weight without its ``<name>_scale_inv``; a ``<name>_scale_inv`` beside a
            weight that is no longer float8 (e.g. ``model.to(torch.bfloat16)`` cast the stored values,
            which are meaningless without their scales).
        ValueError: the module's ``block_size`` is not 128 x 128, or the scales' shape is not the
            weight's block grid.
    """
    scale = getattr(module, f"{name}_scale_inv", None)
    if not isinstance(weight, Tensor):
        return weight
    if weight.dtype != E4M3:
        if isinstance(scale, Tensor) and weight.dtype.is_floating_point:
            raise TypeError(
                f"{name}: has {name}_scale_inv but is {weight.dtype}, not {E4M3}: the stored FP8 values "
                "were cast (model.to(dtype) or .half() cast every floating parameter); load the "
                "checkpoint again and move the model with .to(device) only"
            )
        return weight
    if not isinstance(scale, Tensor):
        raise TypeError(f"{name}: a {E4M3} expert weight needs its block scales {name}_scale_inv, found none")
    block = getattr(module, "block_size", None)
    if block is not None and tuple(block) != (BLOCK, BLOCK):
        raise ValueError(
            f"{name}: moeyard runs FP8 experts with {BLOCK} x {BLOCK} block scales, this module has block_size {block}"
        )
    cache = module.__dict__.setdefault("_moeyard_fp8_views", {})
    hit = cache.get(name)
    if hit is not None and hit.weight is weight and hit.weight_scale_inv is scale and hit.dtype == dtype:
        return hit
    segments = infer_row_segments(weight.shape, scale.shape, gated=_gated(module, name))
    storage = FP8BlockExperts.from_fp8(weight, scale, dtype=dtype, row_segments=segments)  # checks
    if weight.is_contiguous() and scale.dtype == torch.float32 and scale.is_contiguous():
        # over the parameters themselves: no copy, and it follows them when the model moves
        storage = FP8BlockExperts.adopt(weight, scale, dtype=dtype, row_segments=storage.row_segments)
        cache[name] = storage
    return storage


def _gated(module: nn.Module, name: str) -> bool:
    from .apply import gated_rows

    return gated_rows(module, name)


# ---------------------------------------------------------------------- loading


def load_fp8_checkpoint(
    model_or_path,
    checkpoint: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    strict: bool = True,
    **model_kwargs,
) -> nn.Module:
    """Load an FP8 checkpoint of the DeepSeek-V3 / Qwen3-FP8 format with the experts kept in FP8 (module
    docstring) and return the model.

    Two forms::

        model = load_fp8_checkpoint("path/to/Qwen3-30B-A3B-FP8", device="cuda")  # builds the model
        load_fp8_checkpoint(model, "path/to/checkpoint")                          # fills a model you built

    The first builds ``AutoModelForCausalLM.from_config`` (the checkpoint's config without its
    ``quantization_config``, ``experts_implementation="moeyard"`` unless given, parameters on the meta
    device through accelerate's ``init_empty_weights``, so nothing is allocated twice), loads the
    generation config, and returns the model in eval mode, as ``from_pretrained`` does. The second
    loads into an unquantised transformers model of the same architecture (any weights; parameters on
    the meta device too, with real buffers: ``accelerate.init_empty_weights(include_buffers=False)``).
    Either way tensors are read one at a time with safetensors onto ``device``.

    Args:
        model_or_path: a checkpoint directory (``config.json`` and ``model.safetensors`` or
            ``model.safetensors.index.json`` with its shards), or a model (then ``checkpoint`` names
            the directory or one ``.safetensors`` file).
        dtype: compute dtype of the loaded model (the built model's; default the config's ``dtype``,
            else bfloat16). With a model given: its parameters' dtypes are kept.
        device: where the tensors go (default: CPU for a built model, else where each parameter is,
            CPU for meta ones).
        strict: raise on checkpoint tensors nothing consumed and on parameters the checkpoint lacks
            (tied weights excepted).
        model_kwargs: passed to ``from_config`` (``attn_implementation``, ``experts_implementation``, ...).
    Returns:
        The model, its expert weights float8_e4m3fn parameters (``requires_grad=False``) beside
        ``<name>_scale_inv`` float32 ones.
    Raises:
        ValueError: ``quantization_config`` is not FP8 with ``weight_block_size`` ``[128, 128]``, dynamic
            activation scaling and float scales; a tensor of the wrong shape or dtype (named); a model
            wrapped by PEFT (load first, then ``get_peft_model``); no experts module in the model.
        TypeError: ``model_or_path`` is neither a path nor a module; a model given without ``checkpoint``.
        FileNotFoundError: no safetensors checkpoint at the path.
        RuntimeError: with ``strict``, unexpected or missing tensors (all named); a parameter or buffer
            still on the meta device after loading (a model built with buffers on the meta device).
        ImportError: transformers, accelerate (to build the model) or safetensors is missing.
    """
    if isinstance(model_or_path, nn.Module):
        if checkpoint is None:
            raise TypeError("checkpoint: a model was given, so checkpoint must name the FP8 checkpoint to load")
        if model_kwargs:
            raise TypeError(f"model_kwargs: only for building a model from a path, got {sorted(model_kwargs)}")
        model, path, built = model_or_path, os.fspath(checkpoint), False
    elif isinstance(model_or_path, (str, os.PathLike)):
        path = os.fspath(model_or_path)
        model, built = None, True
    else:
        raise TypeError(
            f"model_or_path: expected a checkpoint path or a torch.nn.Module, got {type(model_or_path).__name__}"
        )
    files = checkpoint_files(path)
    config_dir = path if os.path.isdir(path) else os.path.dirname(path)
    block = check_quantization_config(_read_quantization_config(config_dir, model))
    if built:
        model = _build(config_dir, dtype, model_kwargs)
        device = torch.device(device if device is not None else "cpu")
    elif device is not None:
        device = torch.device(device)
    if any(hasattr(m, "base_layer") for m in model.modules()):
        raise ValueError(
            "model: wrapped by PEFT; load the FP8 checkpoint into the base model first, then call "
            "peft.get_peft_model (and moeyard.integrations.peft.fuse_lora)"
        )
    with _open(files, model) as reader:
        _Loader(model, reader, block, device).run(strict)
    if built:
        _generation_config(model, config_dir)
        model.eval()
    return model


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint: ``path`` itself (a file), or a directory's
    ``model.safetensors.index.json`` shards, its ``model.safetensors``, or its only ``*.safetensors``.

    Raises:
        FileNotFoundError: none there.
    """
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint: no such file or directory: {path!r}")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if len(found) == 1:
        return [os.path.join(path, found[0])]
    raise FileNotFoundError(f"checkpoint: no model.safetensors or model.safetensors.index.json in {path!r}")


def check_quantization_config(qc) -> Blocks:
    """The weight blocks of an FP8 ``quantization_config`` (a dict or transformers' config object).

    Raises:
        ValueError: not ``quant_method`` ``"fp8"``, or a ``weight_block_size`` other than ``[128, 128]``,
            static activation scales, ue8m0 scales, or an ``fmt`` other than e4m3 (``"e4m3"``,
            ``"float8_e4m3fn"``; each named).
    """
    if qc is None:
        return Blocks(BLOCK, BLOCK)  # a bare safetensors file: its tensors are checked one by one
    qc = qc if isinstance(qc, Mapping) else qc.to_dict()
    method = str(qc.get("quant_method", ""))
    if method.split(".")[-1].lower() != "fp8":
        raise ValueError(
            f"quantization_config.quant_method: expected 'fp8' (FineGrainedFP8: DeepSeek-V3, Qwen3-FP8), got {method!r}"
        )
    fmt = str(qc.get("fmt") or "e4m3")
    checks = (
        ("weight_block_size", list(qc.get("weight_block_size") or []), [BLOCK, BLOCK]),
        ("activation_scheme", qc.get("activation_scheme") or "dynamic", "dynamic"),
        ("scale_fmt", qc.get("scale_fmt") or "float", "float"),
        ("fmt", "e4m3" if fmt.removeprefix("float8_").removesuffix("fn") == "e4m3" else fmt, "e4m3"),
    )
    for name, got, want in checks:
        if got != want:
            raise ValueError(f"quantization_config.{name}: moeyard loads {want!r}, got {got!r}")
    return Blocks(BLOCK, BLOCK)


def _read_quantization_config(config_dir: str, model):
    config = os.path.join(config_dir, "config.json")
    if os.path.isfile(config):
        with open(config) as f:
            data = json.load(f)
        qc = data.get("quantization_config") or data.get("text_config", {}).get("quantization_config")
        if qc is None:
            raise ValueError(f"quantization_config: {config} has none (not an FP8 checkpoint)")
        return qc
    return getattr(getattr(model, "config", None), "quantization_config", None)


def _build(config_dir: str, dtype, model_kwargs: dict) -> nn.Module:
    """The unquantised model of the checkpoint's config, parameters on the meta device, buffers real."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as ex:
        raise ImportError(
            "building a model from an FP8 checkpoint needs transformers (pip install 'transformers>=5')"
        ) from ex
    try:
        from accelerate import init_empty_weights
    except ImportError as ex:
        raise ImportError(
            "building a model from an FP8 checkpoint needs accelerate (pip install accelerate), "
            "or build it yourself and call load_fp8_checkpoint(model, path)"
        ) from ex
    config = AutoConfig.from_pretrained(config_dir)
    for c in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        if hasattr(c, "quantization_config"):
            del c.quantization_config
    if dtype is None:
        dtype = getattr(config, "dtype", None)
        dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.bfloat16
    model_kwargs.setdefault("experts_implementation", "moeyard")
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, **model_kwargs)


def _generation_config(model: nn.Module, config_dir: str) -> None:
    if os.path.isfile(os.path.join(config_dir, "generation_config.json")):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(config_dir)


class _Reader:
    """Tensors of a sharded safetensors checkpoint by the model's names (the checkpoint's after ``rename``),
    each file opened once."""

    def __init__(self, handles: dict[str, object], rename):
        self.where = {rename(k): (h, k) for h in handles.values() for k in h.keys()}
        self.used: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def get(self, key: str, device) -> Tensor:
        self.used.add(key)
        handle, stored = self.where[key]
        return handle.get_tensor(stored).to(device)

    def unused(self) -> list[str]:
        """The checkpoint's names of the tensors nothing read."""
        return [stored for key, (_, stored) in self.where.items() if key not in self.used]


@contextlib.contextmanager
def _open(files: list[str], model: nn.Module) -> Iterator[_Reader]:
    try:
        from safetensors import safe_open
    except ImportError as ex:
        raise ImportError("loading an FP8 checkpoint needs safetensors (pip install safetensors)") from ex
    with contextlib.ExitStack() as stack:
        yield _Reader(
            {f: stack.enter_context(safe_open(f, framework="pt", device="cpu")) for f in files}, _renamings(model)
        )


def _renamings(model: nn.Module):
    """The checkpoint-to-model key renamings transformers applies when it loads ``model`` (its conversion
    mapping's ``WeightRenaming`` entries, e.g. Mixtral's and MiniMax-M2's ``.block_sparse_moe.`` ->
    ``.mlp.``), as a function of a key; the identity without them. Its merges of per-expert tensors into
    fused ones are done here instead (FP8 kept)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:
        return lambda key: key
    if not isinstance(model, PreTrainedModel):
        return lambda key: key
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]

    def rename(key: str) -> str:
        for r in renamings:
            key, _ = r.rename_source_key(key)
        return key

    return rename


class _Loader:
    """One pass over a model: experts first (FP8 kept), then every other parameter and buffer."""

    def __init__(self, model: nn.Module, reader: _Reader, block: Blocks, device):
        self.model, self.reader, self.block, self.device = model, reader, block, device
        self.missing: list[str] = []

    def run(self, strict: bool) -> None:
        from .apply import expert_parameters

        found = expert_parameters(self.model)
        if not found:
            raise ValueError(
                f"model: no experts module in {type(self.model).__name__} (expected 3-D gate_up_proj "
                "or up_proj and down_proj parameters)"
            )
        expert_names = set()
        for name, owner, attr, p in found:
            expert_names.add(name)
            self._expert(name.rpartition(".")[0], owner, attr, p)
        for name, t in list(self.model.state_dict(keep_vars=True).items()):
            if name not in expert_names and not name.endswith("_scale_inv"):
                self._other(name, t)
        tie = getattr(self.model, "tie_weights", None)
        if callable(tie):
            tie()
        self.missing = [n for n in self.missing if self._still_meta(n)]
        ignore = [re.compile(p) for p in (getattr(self.model, "_keys_to_ignore_on_load_unexpected", None) or [])]
        unexpected = [k for k in self.reader.unused() if not any(p.search(k) for p in ignore)]
        if strict and (unexpected or self.missing):
            raise RuntimeError(
                f"load_fp8_checkpoint: missing tensors {sorted(self.missing)[:20]} (of "
                f"{len(self.missing)}), unexpected tensors {sorted(unexpected)[:20]} "
                f"(of {len(unexpected)})"
            )
        for name, buf in self.model.named_buffers():
            if buf.device.type != "meta" and self.device is not None and buf.device != self.device:
                _set(self.model, name, buf.to(self.device), buffer=True)
        meta = [n for n, t in [*self.model.named_parameters(), *self.model.named_buffers()] if t.device.type == "meta"]
        if meta:
            raise RuntimeError(
                f"load_fp8_checkpoint: still on the meta device after loading: {meta[:10]} (of "
                f"{len(meta)}); buffers a checkpoint does not hold (rotary inv_freq) must be real: "
                "build the model under accelerate.init_empty_weights(include_buffers=False)"
            )

    # -- experts

    def _expert(self, prefix: str, owner: nn.Module, attr: str, p: Tensor) -> None:
        device = self._device(p)
        E, a, b = p.shape
        fused = self._fused(prefix, attr, device)
        if fused is None:
            fused = self._per_expert(prefix, owner, attr, p, device)
        w, s = fused
        name = f"{prefix}.{attr}"
        if w.dtype != E4M3 or tuple(w.shape) != (E, a, b):
            raise ValueError(f"{name}: expected a {E4M3} tensor of shape {(E, a, b)}, got {w.dtype} {tuple(w.shape)}")
        try:
            infer_row_segments(w.shape, s.shape, gated=_gated(owner, attr))
        except ValueError as ex:
            raise ValueError(f"{name}_scale_inv: {str(ex).partition(': ')[2]}") from None
        owner._parameters[attr] = nn.Parameter(w, requires_grad=False)
        owner.register_parameter(f"{attr}_scale_inv", nn.Parameter(s.float(), requires_grad=False))

    def _fused(self, prefix: str, attr: str, device) -> tuple[Tensor, Tensor] | None:
        """``<prefix>.<attr>`` + ``_scale_inv`` (transformers' FP8Experts) or ``.weight`` +
        ``.weight_scale_inv`` (moeyard's FP8BlockExperts), if the checkpoint has them."""
        for w_key, s_key in (
            (f"{prefix}.{attr}", f"{prefix}.{attr}_scale_inv"),
            (f"{prefix}.{attr}.weight", f"{prefix}.{attr}.{SCALE}"),
        ):
            if w_key in self.reader and s_key in self.reader:
                return self.reader.get(w_key, device), self.reader.get(s_key, device)
        return None

    def _per_expert(self, prefix, owner, attr, p, device) -> tuple[Tensor, Tensor]:
        """Per-expert 2-D tensors stacked (gate rows then up rows for ``gate_up_proj``)."""
        E, a, b = p.shape
        if getattr(owner, "is_transposed", False):
            raise ValueError(
                f"{prefix}.{attr}: per-expert checkpoint tensors for a transposed experts module; "
                f"expected fused {prefix}.{attr} and {prefix}.{attr}_scale_inv"
            )
        parts = {"gate_up_proj": (GATE_NAMES, UP_NAMES), "up_proj": (UP_NAMES,), "down_proj": (DOWN_NAMES,)}[attr]
        if attr == "gate_up_proj" and not _gated(owner, attr):
            parts = (UP_NAMES,)
        rows = a // len(parts)
        w = torch.empty(E, a, b, dtype=E4M3, device=device)
        srows, scols = -(-rows // BLOCK), -(-b // BLOCK)
        s = torch.empty(E, srows * len(parts), scols, dtype=torch.float32, device=device)
        for e in range(E):
            for i, names in enumerate(parts):
                key = self._expert_key(prefix, e, names)
                q = self.reader.get(f"{key}.weight", device)
                if q.dtype != E4M3 or tuple(q.shape) != (rows, b):
                    raise ValueError(
                        f"{key}.weight: expected a {E4M3} tensor of shape {(rows, b)}, got {q.dtype} {tuple(q.shape)}"
                    )
                sc = self._scale(f"{key}.{SCALE}", (srows, scols), device)
                w[e, i * rows : (i + 1) * rows] = q
                s[e, i * srows : (i + 1) * srows] = sc
        return w, s

    def _expert_key(self, prefix: str, e: int, names: tuple[str, ...]) -> str:
        for n in names:
            if f"{prefix}.{e}.{n}.weight" in self.reader:
                return f"{prefix}.{e}.{n}"
        raise ValueError(
            f"{prefix}: expert {e} not in the checkpoint (expected {prefix}.{e}.{names[0]}.weight and "
            f".{SCALE}, or fused {prefix}.gate_up_proj and {prefix}.gate_up_proj_scale_inv)"
        )

    def _scale(self, key: str, shape: tuple[int, int], device) -> Tensor:
        if key not in self.reader:
            raise ValueError(f"{key}: missing (the {E4M3} weight's block scales)")
        s = self.reader.get(key, device)
        if not s.is_floating_point() or s.element_size() < 2 or tuple(s.shape) != shape:
            raise ValueError(f"{key}: expected a float32 tensor of shape {shape}, got {s.dtype} {tuple(s.shape)}")
        return s.float()

    # -- everything else

    def _other(self, name: str, current: Tensor) -> None:
        reader = self.reader
        if name not in reader:
            self.missing.append(name)
            return
        base = name.rpartition(".")[0]
        if f"{base}.activation_scale" in reader:
            raise ValueError(f"{base}.activation_scale: static activation scales are not supported (dynamic only)")
        device = self._device(current)
        t = reader.get(name, device)
        if t.dtype == E4M3:
            s = self._scale(f"{base}.{SCALE}", tuple(-(-n // BLOCK) for n in t.shape), device)
            t = dequantize(t, s, self.block)  # float32 products, as the experts' values
        elif t.dtype.is_floating_point and t.element_size() == 1:
            raise ValueError(f"{name}: {t.dtype} weights are not FP8 e4m3 (fmt 'e4m3')")
        if tuple(t.shape) != tuple(current.shape):
            raise ValueError(f"{name}: expected shape {tuple(current.shape)}, got {tuple(t.shape)}")
        _set(self.model, name, t.to(current.dtype), buffer=not isinstance(current, nn.Parameter))

    def _device(self, current: Tensor):
        if self.device is not None:
            return self.device
        return torch.device("cpu") if current.device.type == "meta" else current.device

    def _still_meta(self, name: str) -> bool:
        owner_name, _, attr = name.rpartition(".")
        owner = self.model.get_submodule(owner_name)
        t = owner._parameters.get(attr, owner._buffers.get(attr))
        return t is None or t.device.type == "meta"


def _set(model: nn.Module, name: str, value: Tensor, *, buffer: bool) -> None:
    """Replace parameter / buffer ``name`` by ``value`` (a parameter keeps its ``requires_grad``)."""
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if buffer:
        owner._buffers[attr] = value
        return
    old = owner._parameters[attr]
    owner._parameters[attr] = nn.Parameter(value, requires_grad=old.requires_grad)
