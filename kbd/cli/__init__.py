"""The ``kbd`` command: the console entry and lean exec path (:mod:`.entry`,
:mod:`.exec_args`), the click commands (:mod:`.commands`) and the one error
boundary (:mod:`.boundary`). Importing this package imports nothing else: the
lean path must stay lean."""
