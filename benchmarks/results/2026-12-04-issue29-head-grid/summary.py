"""Summary of this folder's analytic grid (target 1, target 2, steady moves) and its
difference from the dceb04f grid on the real traces. Run from the repository root:
python benchmarks/results/2026-12-04-issue29-head-grid/summary.py"""
import json, re, collections
from pathlib import Path
HERE = Path(__file__).resolve().parent
rows=[]
for f in sorted(HERE.glob('*.json')):
    rows+=json.load(open(f))['rows']
print(len(rows),'rows')
below=[(r['model'],r['trace'],r['ep'],r['preset'],round(r['default/deepseek'],5)) for r in rows if r['default/deepseek']<1.0]
print('below deepseek:', below)
bytrace=collections.defaultdict(list)
for r in rows: bytrace[r['trace']].append((r['default/deepseek'],r['model'],r['ep'],r['preset']))
for t,v in sorted(bytrace.items()):
    v.sort(); print(f'  {t:18s} lowest {v[0][0]:.4f} ({v[0][1]} EP {v[0][2]} {v[0][3]}), {len(v)} rows')
print('target 2: gap to oracle closed, shifting loads, EP 64-256')
for r in sorted(rows,key=lambda r:(r['model'],r['trace'],r['ep'],r['preset'])):
    if r['ep']>=64 and r['trace'] in ('esft','olmoe','shift-zipf','shift-lognormal'):
        closed=(r['default/oracle']-r['noshift/oracle'])/(1-r['noshift/oracle'])
        print(f"  {r['model']:12s} {r['trace']:16s} EP {r['ep']:3d} {r['preset']:7s} default/oracle {r['default/oracle']:.3f} no shift {r['noshift/oracle']:.3f} closed {closed:.2f}")
cl=[(r['default/oracle']-r['noshift/oracle'])/(1-r['noshift/oracle']) for r in rows if r['ep']>=64 and r['trace'] in ('esft','olmoe','shift-zipf','shift-lognormal')]
print('  closed min', round(min(cl),3), 'median', round(sorted(cl)[len(cl)//2],3), 'of', len(cl))
print('steady: moves/rebalance with shift detection vs without')
for r in rows:
    if r['trace']=='steady-lognormal':
        print(f"  {r['model']} EP {r['ep']:3d} {r['preset']:7s} {r['moves_per_rebalance']:.1f} vs {r['moves_per_rebalance_noshift']:.1f}")
# vs the dceb04f device grid (real traces only: the synthetic draws differ by machine)
old={}
for f in sorted((HERE.parent / '2026-12-04-issue29-steady' / 'device-analytic').glob('*.log')):
    for line in open(f):
        m=re.match(r'(\S+)\s+(\S+)\s+EP\s+(\d+) (\w+)\s+default/deepseek ([\d.]+).*moves/rebalance ([\d.]+)',line)
        if m: old[m.group(1),m.group(2),int(m.group(3)),m.group(4)]=(float(m.group(5)),float(m.group(6)))
diff=[]
for r in rows:
    k=(r['model'],r['trace'],r['ep'],r['preset'])
    if r['trace'] in ('esft','olmoe') and k in old:
        o=old[k]; n=(round(r['default/deepseek'],3), r['moves_per_rebalance'])
        if abs(n[0]-o[0])>0.0005 or abs(n[1]-o[1])>0.05: diff.append((k,o,(round(n[0],4),round(n[1],1))))
print('real traces vs dceb04f grid (3 dp, moves): %d differ'%len(diff))
for d in diff: print('  ',d)
