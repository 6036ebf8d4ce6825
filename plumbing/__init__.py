"""Plumbing: what every stage needs that is not the learning. A reader learning RLHF can skip this package.

Plain functions that stop with one line saying what to fix, by concern: the process (flags, ranks, signals), models
(tokenizers, engines), data files, output folders, checkpoints. The stages reach them as plumbing.NAME."""

from .checkpoints import *  # noqa: F401, F403
from .data import *  # noqa: F401, F403
from .folders import *  # noqa: F401, F403
from .models import *  # noqa: F401, F403
from .processes import *  # noqa: F401, F403
