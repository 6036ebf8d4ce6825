"""Plumbing: what every stage needs that is not the learning, in plain functions that stop with one line saying what to
fix, in modules by concern. A reader learning RLHF can skip this package; the stages reach it as plumbing.NAME."""

from .checkpoints import *  # noqa: F401, F403
from .data import *  # noqa: F401, F403
from .folders import *  # noqa: F401, F403
from .models import *  # noqa: F401, F403
from .processes import *  # noqa: F401, F403
