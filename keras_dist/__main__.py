import sys

from keras_dist.cli import main

sys.exit(main())
