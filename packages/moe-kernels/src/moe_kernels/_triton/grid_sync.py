"""A barrier across all programs of one launch, for kernels launched cooperatively.

``grid_sync(bar_ptr, n_programs)`` returns in every program once all ``n_programs`` have reached
it, with every store made before it by any program visible to every load after it. It is only
correct when every program of the grid is resident at once, so its kernels are launched with
``launch_cooperative_grid=True`` (CUDA then refuses a grid that does not fit, rather than
hanging) and the launchers keep such grids to at most one program per SM.

The barrier's state is two int32 words in device memory, (arrived, generation), that start at
zero and are back at (0, g + 1) after each use, so one pair serves any number of launches one
after another, with any grid size, without a reset. Launches that may overlap in time must not
share a pair: ``barrier_words`` keeps one pair per (device, stream), and the launchers do not
use it while a CUDA graph is being captured (a graph may be replayed on any stream).

The interpreter runs programs one after another, so a program waiting for the others never
returns there: the launchers run the two phases as two launches instead under
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def grid_sync(bar_ptr, n_programs):
    """Wait until all ``n_programs`` programs of the launch have arrived (see the module).

    Arrival: a CTA barrier (all of the program's stores issued), then one acq_rel add to the
    arrival count. The last to arrive resets the count and releases the next generation; the
    others spin on the generation word with acquire loads (atomics, so nothing hoists or
    caches them), then a CTA barrier lets the whole program go on."""
    tl.debug_barrier()
    gen = tl.atomic_add(bar_ptr + 1, 0, sem="relaxed", scope="gpu")  # read before arriving
    arrived = tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == n_programs - 1:
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(bar_ptr + 1, gen + 1, sem="release", scope="gpu")
    else:
        now = tl.atomic_add(bar_ptr + 1, 0, sem="acquire", scope="gpu")
        while now == gen:
            now = tl.atomic_add(bar_ptr + 1, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


_WORDS: dict[tuple[int, int], torch.Tensor] = {}
_MAX_WORDS = 64


def barrier_words(device: int, stream: int) -> torch.Tensor:
    """The (arrived, generation) pair of ``stream`` on ``device``, int32 (zeroed on first use,
    on that stream, which must be the current one). Not for use during CUDA graph capture."""
    key = (device, stream)
    words = _WORDS.get(key)
    if words is None:
        if len(_WORDS) >= _MAX_WORDS:
            # Start over. A dropped pair's memory goes back to the caching allocator for its
            # stream only, so a later kernel reusing it runs after any launch still using it.
            _WORDS.clear()
        words = _WORDS[key] = torch.zeros(2, dtype=torch.int32, device=f"cuda:{device}")
    return words
