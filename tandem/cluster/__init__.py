"""tandem on Ray: engine replicas, the flywheel's trainer, Ray Serve and RL rollout workers as actors.

Above flywheel, rl and server (it implements their interfaces: TraceSink, Trainer, WeightStore, the engine
loop, RolloutEngine) and imported only by the cli. Ray is optional: nothing here imports it at module load.
"""
