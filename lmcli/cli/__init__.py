"""The command line: one module a command group, the app in ``app.py`` (the ``lmcli``
console script is ``lmcli.cli.app:main``); only this package imports Typer.
"""
