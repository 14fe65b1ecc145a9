"""Runnable training scripts that use `course_utils` the way a project would (`python -m course_utils.examples.X`)."""
