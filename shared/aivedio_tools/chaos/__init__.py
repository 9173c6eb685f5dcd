"""The chaos suite (`aivedio chaos`): the real stack as OS processes under a seeded fault plan, a
recorded history, and checkers that are pure functions of the recorded files. Only `safeguards`
and `failpoints` are imported by the platform's core, and both are inert unless a local run arms
them explicitly."""
