# The browser test's fixture notebooks are driven by the browser test itself, not by nbval.
collect_ignore_glob = ["browser/*.ipynb", "**/.ipynb_checkpoints/*"]
