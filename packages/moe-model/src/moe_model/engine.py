"""``WorldEngine``: the runtime of the world model (``world.py``): KV ring buffer, seeded noise,
controller state, eager / compiled / CUDA-graph passes, frame-by-frame rollout, checkpoints.

Per frame: ``denoise_steps`` rectified-flow Euler steps of a new latent, from seeded noise
(sigma 1 -> 0), each one a denoise pass that reads the KV cache (only the scratch slot is written);
then one cache pass on the clean latent (sigma 0) that writes the frame's keys/values into the ring
and advances the device frame counter; optionally the decoder turns the latent into an image.

The cache pass of frame t runs at the start of frame t + 1, in one forward with that frame's first
denoise pass (``WorldModel.commit_and_denoise``: 2N tokens, every weight read once for both; the
same math as the two passes one after the other). Frame 0 runs its denoise pass alone.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import numbers
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn
from torch.profiler import record_function

from moe_model._checks import check_device
from moe_model._moe_options import check_bool
from moe_model.config import WorldModelConfig
from moe_model.impls import IMPLS, KERNEL_DTYPES, check_dtype, check_impl
from moe_model.kv_cache import KVRingCache
from moe_model.moe import MoELayer
from moe_model.world import WorldModel, check_config, model_parameter_counts

Ctrl = Mapping[str, object] | None

# A frame's work: (pair, masked) (``WorldEngine._variant``).
VARIANTS = ((False, True), (True, True), (True, False))

# torch.profiler ranges around a frame's transformer work and its decode (what ``moe-bench
# rollout --profile`` attributes kernels by; near free when no profiler runs).
FRAME_SCOPE = "moe_model::frame"
DECODE_SCOPE = "moe_model::decode"


def _check_device(device: object) -> torch.device:
    """The engine's device: None picks CUDA when available, else the CPU. ValueError for what
    torch cannot parse or reach here (``check_device``), and for meta."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = check_device(device)
    if dev.type == "meta":
        raise ValueError(
            "device='meta': the engine needs a real device (it holds weights, a KV cache and a "
            "noise generator); moe_model.count_parameters(cfg) sizes a config without memory"
        )
    return dev


def _check_dtype(dtype: object, moe_impl: str | None) -> None:
    """TypeError naming ``dtype`` unless the MoE impl takes it (``check_dtype``) and it is one
    of ``KERNEL_DTYPES`` (float16, bfloat16, float32): the attention's ``qk_norm_rope`` reads
    no other, whatever the MLP (float64 is refused even with the torch impl or a dense MLP)."""
    check_dtype(dtype, moe_impl, name="dtype")
    if dtype not in KERNEL_DTYPES:
        raise TypeError(
            f"dtype must be one of {KERNEL_DTYPES} (the attention's moe_kernels.qk_norm_rope "
            f"reads no other), got {dtype!r}"
        )


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    """TypeError unless an int (a bool is not), ValueError unless in [lo, hi)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < lo or (hi is not None and value >= hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
        raise ValueError(f"{name} must be {bounds}, got {value}")


def _ctrl_tensors(ctrl: Ctrl, n_buttons: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(buttons multi-hot (n_buttons,), mouse (2,)) fp32 CPU tensors from a ctrl mapping.

    ``buttons`` is read by its type, never by its values:

    * a bool or floating tensor is a multi-hot: shape (n_buttons,), every value exactly 0 or 1
      (ValueError otherwise: 7.0 is not "pressed 7 times");
    * integers (a list, tuple or other iterable of ints, or an integer tensor, 0-D or 1-D) are the
      pressed indices, in any order, each in [0, n_buttons), none repeated. An integer tensor
      of shape (n_buttons,) is indices too: ``torch.tensor([0, 0, 1, 0])`` repeats 0, a
      ValueError saying to pass a multi-hot as a bool or floating tensor.

    A tensor on another device is read on the host (its values are checked).
    """
    buttons = torch.zeros(n_buttons)
    mouse = torch.zeros(2)
    if ctrl is None:
        return buttons, mouse
    if not isinstance(ctrl, Mapping):
        raise TypeError(f"ctrl must be None or a mapping with 'buttons'/'mouse', got {ctrl!r}")
    unknown = set(ctrl) - {"buttons", "mouse"}
    if unknown:
        raise ValueError(f"unknown ctrl keys {sorted(unknown)}; expected 'buttons', 'mouse'")
    b = ctrl.get("buttons")
    if isinstance(b, torch.Tensor) and (b.dtype.is_floating_point or b.dtype == torch.bool):
        if b.shape != (n_buttons,):
            raise ValueError(
                f"buttons multi-hot must have shape ({n_buttons},), got {tuple(b.shape)}"
            )
        buttons = b.detach().float().cpu()
        if not torch.isfinite(buttons).all():
            raise ValueError(f"buttons multi-hot must be finite, got {buttons.tolist()}")
        if not ((buttons == 0) | (buttons == 1)).all():
            raise ValueError(
                f"buttons multi-hot must hold only 0 and 1, got {buttons.tolist()} (pass the "
                "pressed indices, or a bool tensor)"
            )
    elif b is not None:
        if isinstance(b, torch.Tensor) and b.dim() > 1:
            raise ValueError(f"buttons index tensor must be 1-D, got shape {tuple(b.shape)}")
        indices = b.reshape(-1).tolist() if isinstance(b, torch.Tensor) else b
        if isinstance(indices, (str, bytes)) or not isinstance(indices, Iterable):
            raise TypeError(f"buttons must be button indices or a multi-hot tensor, got {b!r}")
        indices = list(indices)
        for i in indices:
            if isinstance(i, bool) or not isinstance(i, numbers.Integral):
                raise TypeError(f"button indices must be ints, got {i!r}")
            if not 0 <= i < n_buttons:
                raise ValueError(f"button index {i} out of range [0, {n_buttons})")
            if buttons[int(i)]:
                raise ValueError(
                    f"buttons repeats index {i}: integer buttons are pressed indices (got "
                    f"{indices!r}); pass a multi-hot as a bool or floating tensor of "
                    f"shape ({n_buttons},)"
                )
            buttons[int(i)] = 1.0
    if ctrl.get("mouse") is not None:
        try:
            mouse = torch.as_tensor(ctrl["mouse"], dtype=torch.float32).detach().cpu().reshape(-1)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"mouse must be 2 numbers (dx, dy), got {ctrl['mouse']!r}") from None
        if mouse.numel() != 2 or not torch.isfinite(mouse).all():
            raise ValueError(f"mouse must hold 2 finite floats (dx, dy), got {mouse.tolist()}")
    return buttons, mouse


class WorldEngine:
    """Generates frames one after another; see the package README for the API."""

    def __init__(
        self,
        config: WorldModelConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        impl: str | None = None,
        compile: bool = False,
        cuda_graph: bool | None = None,
        seed: int = 0,
        _init_weights: bool = True,
    ) -> None:
        check_config(config)
        if impl is not None:
            config = dataclasses.replace(config, moe_impl=check_impl(impl))
        moe_impl = check_impl(config.moe_impl) if config.mlp == "moe" else None
        self.config = cfg = config
        self.device = _check_device(device)
        _check_dtype(dtype, moe_impl)
        _check_int("seed", seed, -(2**63), 2**64)  # the range torch.manual_seed takes
        cuda_graph = self._check_runtime(compile, cuda_graph)
        self.dtype, self.seed = dtype, seed
        if _init_weights:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = WorldModel(cfg)
                model.init_weights()
            model.to(self.device)
        else:
            with torch.device("meta"):
                model = WorldModel(cfg)
            model.to_empty(device=self.device)
            model.rope.init_buffers()
        for name, p in model.named_parameters():  # routers stay fp32, buffers (RoPE) stay fp32
            if not name.endswith("router.weight"):
                p.data = p.data.to(dtype)
        if _init_weights:
            _quantize_fp8_experts(model)
        self.model = model.eval().requires_grad_(False)
        dev = self.device
        self.cache = KVRingCache(
            cfg.n_layers,
            cfg.n_kv_heads,
            cfg.window,
            cfg.tokens_per_frame,
            cfg.head_dim,
            device=dev,
            dtype=dtype,
        )
        self._gen = torch.Generator(device=dev)
        self._gen.manual_seed(seed)
        # Static buffers: controller state, noise, sigmas, outputs.
        self._buttons = torch.zeros(cfg.n_buttons, device=dev)
        self._mouse = torch.zeros(2, device=dev)
        # The controller state of the last frame, whose cache pass runs with the next frame.
        self._prev_buttons = torch.zeros_like(self._buttons)
        self._prev_mouse = torch.zeros_like(self._mouse)
        self._last_ctrl: tuple | None = None
        self._noise = torch.zeros(cfg.latent_channels, cfg.latent_h, cfg.latent_w, device=dev)
        self._sigmas = torch.linspace(1.0, 0.0, cfg.denoise_steps + 1, device=dev)
        self._latent = torch.zeros_like(self._noise)
        self._img = torch.zeros(
            8 * cfg.latent_h, 8 * cfg.latent_w, 3, dtype=torch.uint8, device=dev
        )
        self._graphs: dict[tuple[bool, bool], torch.cuda.CUDAGraph] = {}
        self._graph_dec: torch.cuda.CUDAGraph | None = None
        self._frames_done = 0  # frames generated (chooses the variant; no device read)
        self.compiled = False
        self.set_runtime(compile=compile, cuda_graph=cuda_graph)

    def set_runtime(self, *, compile: bool, cuda_graph: bool | None = None) -> None:
        """Switch between eager, ``torch.compile(fullgraph=True)`` denoise and cache passes, and
        CUDA-graph replay (captured now, after a warm-up; the state is then reset). The decoder
        is compiled too (H200: 334 against 560 us a frame in a CUDA graph, images within one
        level of eager's), inside its own CUDA graph when ``cuda_graph``. ``cuda_graph=None`` (the
        default) means ``compile`` on a CUDA device: the fast mode unless told otherwise.
        Compiling (graphs or not) runs both pass variants once now, then resets the state."""
        cuda_graph = self._check_runtime(compile, cuda_graph)
        newly_compiled = compile and not self.compiled
        if compile and self.compiled:
            pass  # keep the compiled passes (and dynamo's cache)
        elif compile:
            self._step_fn = torch.compile(self._denoise_step, fullgraph=True)
            self._pair_fn = torch.compile(self._commit_and_step, fullgraph=True)
            self._decode_fn = torch.compile(self.model.decoder, fullgraph=True)
        else:
            self._step_fn, self._pair_fn = self._denoise_step, self._commit_and_step
            self._decode_fn = self.model.decoder
        self.compiled, self.cuda_graph = compile, cuda_graph
        self._graphs, self._graph_dec = {}, None
        if cuda_graph:
            self._capture()
        elif newly_compiled:
            self._warm_up()

    def _warm_up(self) -> None:
        """Compile every variant of the passes and the decoder now (then reset the state), not
        at the first frame that needs each: the unmasked one would otherwise compile mid-rollout,
        at frame ``window + 1`` (about 30 s for seed-moe on the H200's host)."""
        for variant in VARIANTS:
            self._frame_work(*variant)
            self._decode_work()
        self.reset()

    def _check_runtime(self, compile: object, cuda_graph: object) -> bool:
        """The checked ``cuda_graph`` flag, None resolved to ``compile`` on CUDA."""
        check_bool("compile", compile)
        if cuda_graph is None:
            return bool(compile) and self.device.type == "cuda"
        check_bool("cuda_graph", cuda_graph)
        if cuda_graph and self.device.type != "cuda":
            raise ValueError("cuda_graph=True needs a CUDA device")
        return cuda_graph

    # -- device work of one frame (static shapes, no host syncs) --------------------------------

    # Three variants of a frame's work (``VARIANTS``, ``_variant()``): frame 0's denoise pass
    # alone; later frames with the previous frame's cache pass in front (``pair``), ``masked``
    # while the ring is filling, unmasked once every slot holds a frame (SDPA may then use its
    # flash kernel). The host knows which one applies from its own frame count: no device read.

    def _denoise_step(
        self, z: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor, masked: bool
    ) -> torch.Tensor:
        b, m = self._buttons, self._mouse
        v = self.model(z, sigma, b, m, self.cache, commit=False, masked=masked)
        return z + (sigma_next - sigma) * v

    def _commit_and_step(
        self,
        clean: torch.Tensor,
        z: torch.Tensor,
        sigma: torch.Tensor,
        sigma_next: torch.Tensor,
        masked: bool,
    ) -> torch.Tensor:
        """The last frame's cache pass and this frame's first Euler step, one forward."""
        v = self.model.commit_and_denoise(
            clean, self._prev_buttons, self._prev_mouse, z, sigma, self._buttons, self._mouse,
            self.cache, masked=masked,
        )  # fmt: skip
        self.cache.advance()
        return z + (sigma_next - sigma) * v

    def _variant(self) -> tuple[bool, bool]:
        """(pair, masked) of the next frame's work: the cache pass of frame n - 1 runs with
        frame n > 0; unmasked once the ring was full before that commit (n - 1 >= window)."""
        n = self._frames_done
        return n > 0, n == 0 or n - 1 < self.config.window

    @torch.no_grad()
    def _frame_work(self, pair: bool, masked: bool) -> None:
        z, s = self._noise, self._sigmas
        first = 0
        if pair:
            z, first = self._pair_fn(self._latent, z, s[0], s[1], masked), 1
        for i in range(first, self.config.denoise_steps):
            z = self._step_fn(z, s[i], s[i + 1], masked)
        self._latent.copy_(z)
        self._prev_buttons.copy_(self._buttons)
        self._prev_mouse.copy_(self._mouse)

    @torch.no_grad()
    def _decode_work(self) -> None:
        self._img.copy_(self._decode_fn(self._latent))

    def _capture(self) -> None:
        """Warm up (compiles, autotunes) on a side stream, capture, then reset the state."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for variant in VARIANTS * 2:
                self._frame_work(*variant)
                self._decode_work()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        # Every persistent tensor (cache, latent, image) lives outside the graphs' pool, so the
        # three graphs (never replayed concurrently) can share it.
        pool = None
        for variant in VARIANTS:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._frame_work(*variant)
            pool = graph.pool()
            self._graphs[variant] = graph
        self._graph_dec = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph_dec, pool=pool):
            self._decode_work()
        self.reset()

    # -- public API ------------------------------------------------------------------------------

    def reset(self) -> None:
        """Empty the KV cache, frame counter to 0, controller cleared, noise re-seeded."""
        self.cache.reset()
        self._frames_done = 0
        self._gen.manual_seed(self.seed)
        for t in (self._buttons, self._mouse, self._prev_buttons, self._prev_mouse):
            t.zero_()
        self._last_ctrl = None

    @property
    def frame_index(self) -> torch.Tensor:
        """Frames generated since the last reset (0-d int64 device tensor; the last one's keys
        and values reach the cache with the next frame)."""
        return self.cache.frame + int(self._frames_done > 0)

    def _set_ctrl(self, ctrl: Ctrl) -> None:
        buttons, mouse = _ctrl_tensors(ctrl, self.config.n_buttons)
        key = (tuple(buttons.tolist()), tuple(mouse.tolist()))
        if key != self._last_ctrl:  # copy only on change: no host->device copy per frame
            self._buttons.copy_(buttons)
            self._mouse.copy_(mouse)
            self._last_ctrl = key

    @torch.no_grad()
    def gen_frame(self, ctrl: Ctrl = None, return_img: bool = True) -> torch.Tensor:
        """Generate the next frame.

        ctrl: None, or ``{"buttons": pressed indices (ints, distinct) or a (n_buttons,) bool /
        float multi-hot of 0s and 1s, "mouse": (dx, dy)}``: an integer tensor is indices, never
        a multi-hot (``_ctrl_tensors`` states the rule; ValueError for what breaks it).
        Returns the RGB image (8*latent_h, 8*latent_w, 3) uint8 on the CPU when ``return_img``,
        else the clean latent (C, latent_h, latent_w) fp32 on the engine's device (a copy).
        """
        check_bool("return_img", return_img)
        with record_function(FRAME_SCOPE):
            self._set_ctrl(ctrl)
            self._noise.normal_(generator=self._gen)
            variant = self._variant()
            if self._graphs:
                self._graphs[variant].replay()
            else:
                self._frame_work(*variant)
            self._frames_done += 1
        if not return_img:
            return self._latent.clone()
        with record_function(DECODE_SCOPE):
            if self._graph_dec is not None:
                self._graph_dec.replay()
            else:
                self._decode_work()
        return self._img.to("cpu", copy=True)

    def rollout(
        self, n_frames: int, ctrl: Ctrl | Sequence[Ctrl] = None, return_img: bool = True
    ) -> Iterator[torch.Tensor]:
        """Yield ``n_frames`` frames (continuing from the current state; ``reset()`` to restart).
        ctrl: one ctrl for every frame, or a sequence of ``n_frames`` ctrls. The arguments (every
        ctrl included) are checked by this call, before the first frame."""
        _check_int("n_frames", n_frames, 0)
        check_bool("return_img", return_img)
        seq = isinstance(ctrl, Sequence) and not isinstance(ctrl, (str, Mapping))
        if seq and len(ctrl) != n_frames:
            raise ValueError(f"got {len(ctrl)} ctrls for {n_frames} frames")
        for c in ctrl if seq else (ctrl,):
            _ctrl_tensors(c, self.config.n_buttons)
        ctrls: Iterable[Ctrl] = ctrl if seq else itertools.repeat(ctrl, n_frames)
        return (self.gen_frame(c, return_img=return_img) for c in ctrls)

    def num_parameters(self) -> int:
        """All parameters (transformer, embeddings, decoder)."""
        return model_parameter_counts(self.model, self.config)[0]

    def num_active_parameters(self) -> int:
        """Parameters used per token: total minus (n_experts - top_k) experts per layer."""
        return model_parameter_counts(self.model, self.config)[1]

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write ``config.json`` and ``model.safetensors`` into directory ``path``."""
        from safetensors.torch import save_file

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2))
        state = {k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()}
        save_file(state, str(out / "model.safetensors"))

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        impl: str | None = None,
        compile: bool = False,
        cuda_graph: bool | None = None,
        seed: int = 0,
    ) -> WorldEngine:
        """Load an engine written by ``save_pretrained`` (weights cast to ``dtype``; routers
        stay fp32)."""
        from safetensors.torch import load_file

        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        src = Path(path)
        for name in ("config.json", "model.safetensors"):
            if not (src / name).is_file():
                raise FileNotFoundError(
                    f"path={str(path)!r} holds no {name}: from_pretrained reads a folder written "
                    "by save_pretrained"
                )
        try:
            config = json.loads((src / "config.json").read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{src / 'config.json'} is not valid JSON: {exc}") from None
        cfg = WorldModelConfig.from_dict(config)
        # Built (device, dtype, impl checked) before the weights are read; captured (if asked)
        # only once they are loaded.
        eng = cls(
            cfg,
            device=device,
            dtype=dtype,
            impl=impl,
            compile=compile,
            cuda_graph=False,
            seed=seed,
            _init_weights=False,
        )
        state = load_file(str(src / "model.safetensors"))
        params = dict(eng.model.named_parameters())
        missing = set(params) - set(state)
        unexpected = set(state) - set(params)
        shapes = sorted(n for n in set(params) & set(state) if params[n].shape != state[n].shape)
        if missing or unexpected or shapes:
            raise ValueError(
                f"checkpoint mismatch: missing {sorted(missing)}, unexpected {sorted(unexpected)}, "
                f"other shapes than config.json's {shapes}"
            )
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(state[name])
        _quantize_fp8_experts(eng.model)
        if eng._check_runtime(compile, cuda_graph):
            eng.set_runtime(compile=compile, cuda_graph=True)
        return eng


def _quantize_fp8_experts(model: nn.Module) -> None:
    """The MoE layers of the ``"fp8"`` impl quantise their experts as the weights now are."""
    for m in model.modules():
        if isinstance(m, MoELayer) and IMPLS[m.impl].fp8_experts:
            m.quantize_experts()
