"""Notebooks run under nbval wherever nbval is installed (CI, the README's test command).

The options are set here, not in ``addopts``: the GPU machine has no Jupyter stack, and an unknown
``--nbval-*`` option in ``addopts`` would stop ``python3 -m pytest -m gpu`` before it collects anything.
"""


def pytest_configure(config) -> None:
    if config.pluginmanager.hasplugin("nbval"):
        opt = config.option
        if not opt.nbval:  # strict output comparison only when asked for
            opt.nbval_lax = True
        opt.nbval_current_env = True
        opt.nbval_cell_timeout = 600
