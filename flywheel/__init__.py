"""The application floor: the `flywheel` CLI and the demo loop. It may import every stage
(streaming -> feature_repo -> models -> serving) and the ground floor (infra/); nothing imports it."""
