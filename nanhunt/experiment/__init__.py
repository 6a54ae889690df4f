"""Experiments: the user's script re-run with one thing changed. Fix specs (:mod:`nanhunt.fixspec`,
the spec language the analysis writes too) are installed from outside the script
(:mod:`.fixes`); the re-run sandbox keeps the user's files untouched (:mod:`.sandbox`); the re-run
verification (:mod:`.verify`) runs the children through the fork server
(:mod:`nanhunt.cli.forkserver`, which runs the CLI in each child)."""
