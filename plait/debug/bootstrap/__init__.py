"""The folder `plait.debug.bootstrap_dir()` names: its sitecustomize.py activates debugging in
a worker that never imports plait. A package only so that installs ship the file."""
