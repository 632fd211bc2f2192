"""The parts the composition root runs besides the frontend and the poll: the enforcer it hands
each snapshot to (`enforcement`), and the optional parts the config turns on and off while the
daemon runs (`optional`: the MPS control daemon, `mps`; the node feature file, `nodelabels`).
Each follows a live reload through `reconfigure(old, new)`."""
