# These notebooks are hostile on purpose (endless loops, memory bombs, gigabytes of output): tests/test_grader.py
# grades them under the grader's limits; nbval must never run them itself.
collect_ignore_glob = ["*.ipynb", "*/*.ipynb"]
