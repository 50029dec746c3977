"""Weight sync: the controller (freeze, drain, transfer, bump, resume), its transports, the engine in its
own process, and rollouts that overlap training."""
