"""The headline report (`tandem bench report`): runs the headline benchmarks and writes their table."""
