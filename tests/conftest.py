import os

# The browser test's fixture notebooks are driven by the browser test itself, not by nbval.
collect_ignore_glob = ["browser/*.ipynb", "**/.ipynb_checkpoints/*"]

# Tests never need a GPU: keep CPU runs from touching CUDA, and keep the exercise timeouts reliable.
os.environ.setdefault("COURSE_TESTING", "1")
