"""rng-under-ep's round trips, for the tests and ``selftest`` only: :mod:`.core` on Megatron-LM
(registered in :mod:`.scenarios`), and one module per framework, driven through its own functions
(:mod:`.bridge`, :mod:`.verl`, :mod:`.ms_swift`)."""
