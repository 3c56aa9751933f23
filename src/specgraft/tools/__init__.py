"""Tools that drive a loaded engine: Graft's calibration run (``specgraft calibrate``) and the lossy rules'
distortion measurement (``specgraft distortion``). They sit above the engine; the algorithm packages
(``graft/``, ``lossy/``) never import them."""
