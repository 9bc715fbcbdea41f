"""Generation: the engine (a model's compute for every driver), one Sequence (sampler,
detokenizer, stop matcher, stats), sampling, chat templates, the prefix cache."""
