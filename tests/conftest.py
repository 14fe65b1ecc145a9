import os

# Before anything imports torch (OpenMP reads it once, at load): threads waiting for work spin briefly, then sleep,
# as in every notebook's first cell (notebook 04, "A machine that is not yours alone"). Inherited by the notebooks'
# kernels and every worker process the tests start.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

# The browser test's fixture notebooks are driven by the browser test itself, not by nbval.
collect_ignore_glob = ["browser/*.ipynb", "**/.ipynb_checkpoints/*"]
