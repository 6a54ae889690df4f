"""Seeds Python's, NumPy's and torch's default random generators at interpreter start, as
``accelerate.utils.set_seed(0)`` at the top of a script would.

For corpus scripts that never seed (diffusers' ``train_unconditional.py`` has no seed option):
torch seeds its default generator from the operating system, so without this two plain runs
initialise different weights and draw different noise, and no run can be compared with
another. Put on ``PYTHONPATH`` (the entry's ``standins/seed``) for the plain run and every
nanhunt run alike; nanhunt's own start-up then runs after the seeding, so a random number it
drew would change the script's training, which the corpus's comparisons would see.
"""

import random

import numpy
import torch

random.seed(0)
numpy.random.seed(0)
torch.manual_seed(0)
