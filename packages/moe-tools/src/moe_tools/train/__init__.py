"""``moe-bench train``: every ``moe_model.MoELayer`` implementation as a training layer.

* ``measure``: the measurement (step time, memory, gradient errors, repeatability, convergence);
* ``step``: the training layer (built, sized, copied per impl) and one timed training step;
* ``roofline``: the layer's forward + backward against its six grouped GEMMs;
* ``sweep``: ``--sweep``, that roofline over a grid of shapes;
* ``report``: the results as text, figures and a markdown section;
* ``command``: the CLI (options, result name, the ``COMMAND`` that ``moe_tools.commands`` lists).
"""

from moe_tools.train.command import COMMAND

__all__ = ["COMMAND"]
