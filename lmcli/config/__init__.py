"""Every option of lmcli, declared once: the option machinery (``fields``), the model's
architecture (``model``), training (``train``), the other commands (``commands``) and config
files (``files``). The CLI's flags are derived from these dataclasses (``lmcli.cli.options``).
"""
