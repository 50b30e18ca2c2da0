"""`zsim calibrate`: measure this machine so the simulator predicts from measured numbers.

Torch is imported only by `zsim.calibrate.worker` (run under torchrun); everything else here
(the plan, the fit, profile I/O, plots, the launcher) works without torch, so a profile can be
loaded and sampled on a machine that has no torch.

    plan.py     what to measure (a `Plan`) and the measurement rows the workers return
    worker.py   the torchrun worker: timing of kernels, layers, copies, Adam, collectives
    fit.py      measurement rows -> DeviceProfile (least squares) and the fit's residuals
    profile.py  save_profile / load_profile / sample_profiles
    keys.py     model_signature and the layer-time key the simulator looks up
    runner.py   launch torchrun, show progress, write JSON + CSV + PNG atomically
    plots.py    measured vs fitted figures
    cli.py      the `zsim calibrate` command
"""
