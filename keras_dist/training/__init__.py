"""One distributed `fit`, `evaluate` or `predict`: turning the distribution on
and off around it (`session`), and one writer for every file a job of several
processes saves (`saving`)."""
