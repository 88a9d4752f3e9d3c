"""One model over several ranks: a worker's layout (``layout``), how its ranks start and meet
(``group``, ``comm``, ``rank``), and how a step runs over pipeline stages (``stage``)."""
