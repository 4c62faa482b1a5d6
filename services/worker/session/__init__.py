"""One engine-resident session and everything that runs it."""
