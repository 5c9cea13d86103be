"""moe_model.WorldEngine: a frame-autoregressive world model rolling out a few frames at the
"tiny" preset (16 tokens a frame, seconds on a CPU), with and without controller input; checks
that a rollout is reproducible from its seed and that the controller changes the frames.

    python examples/world_rollout.py

On CUDA, WorldEngine(..., compile=True) compiles the passes and replays each frame from CUDA
graphs (the fast mode; it compiles when built, so it pays off over long rollouts).
"""

# README >>>
import torch

from moe_model import WorldEngine, WorldModelConfig

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
config = WorldModelConfig.from_preset("tiny")  # or "seed-moe": 512 tokens a frame, 8 layers
engine = WorldEngine(config, device=device, dtype=dtype, seed=0)
frames = list(engine.rollout(4))  # uint8 (8 * latent_h, 8 * latent_w, 3) images on the CPU
engine.reset()  # empty KV cache, frame 0, noise re-seeded
ctrl = {"buttons": [1], "mouse": (0.5, -0.25)}  # pressed button indices, mouse (dx, dy)
steered = list(engine.rollout(4, ctrl=ctrl))
# README <<<

engine.reset()
again = list(engine.rollout(4))
assert all(map(torch.equal, frames, again)), "a rollout replays from its seed"
assert frames[0].shape == (8 * config.latent_h, 8 * config.latent_w, 3)
assert frames[0].dtype == torch.uint8 and frames[0].device.type == "cpu"
assert not all(map(torch.equal, frames, steered)), "the controller changes the frames"
assert int(engine.frame_index) == 4

latent = engine.gen_frame(return_img=False)  # the next frame's clean latent, on the device
assert latent.shape == (config.latent_channels, config.latent_h, config.latent_w)

mean = [round(f.float().mean().item(), 1) for f in frames]
changed = sum(int((a != b).any(-1).sum()) for a, b in zip(frames, steered, strict=True))
sizes = f"{engine.num_parameters():,} parameters, {engine.num_active_parameters():,} active"
print(f"device {device}, {dtype}: preset tiny, {sizes}")
print(f"  4 frames {tuple(frames[0].shape)} uint8, mean levels {mean}; replayed bit for bit")
pixels = 4 * frames[0][..., 0].numel()
print(f"  with buttons [1] and mouse (0.5, -0.25): {changed} of {pixels} pixels differ")
print("OK")
