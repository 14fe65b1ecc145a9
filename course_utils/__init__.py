"""Helpers for the course "GPU training in PyTorch".

Import what you need from the submodules (`course_utils.data`, `.models`, `.memory`, `.amp`,
`.monitor`, `.timing`, `.exercises`); the most used names are also available here.
Importing this package starts no threads, initialises no GPU and prints nothing.
"""
from .device import get_device
from .environment import describe_environment
from .i18n import get_language, set_language
from .trainer import Callback, Trainer

__all__ = ["get_device", "describe_environment", "Trainer", "Callback", "set_language", "get_language"]
__version__ = "0.1.0"
