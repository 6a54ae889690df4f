"""Analysis of a recorded trace, torch-free: the diagnosis rules (:mod:`.diagnose`), crash
causes (:mod:`.crash`), recommendations (:mod:`.advise`), their installable fixes
(:mod:`.remedies`) and the precision audit's ranking (:mod:`.rank`)."""
