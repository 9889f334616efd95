"""The cost model adaptive placement prices options with, one concern per module
(pdd.router.estimator feeds them and hands placement a frozen snapshot)."""
