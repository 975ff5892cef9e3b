"""Where each agent's cache is: hot (the pool), cool (quantized in memory), warm (disk), cold (gone)."""
