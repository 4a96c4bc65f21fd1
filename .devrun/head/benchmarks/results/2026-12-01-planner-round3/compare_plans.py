import sys, numpy as np
a, b = np.load(sys.argv[1]), np.load(sys.argv[2])
bad = [k for k in a.files if not np.array_equal(a[k], b[k])]
print(len(a.files), "plans;", "ALL IDENTICAL" if not bad else "DIFFERENT: " + ", ".join(bad))
