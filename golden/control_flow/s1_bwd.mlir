module @jit_s1_bwd attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<i1> {sdy.sharding = #sdy.sharding<@mesh, []>}, %arg1: tensor<4x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg2: tensor<4x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg3: tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) -> (tensor<8x8xf32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<4x8xf32> {jax.result_info = "result[1]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) {
    %0 = stablehlo.convert %arg0 : (tensor<i1>) -> tensor<i32>
    %1 = "stablehlo.case"(%0) ({
      %3 = stablehlo.dot_general %arg2, %arg1, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<8x8xf32>
      %4 = stablehlo.transpose %3, dims = [1, 0] : (tensor<8x8xf32>) -> tensor<8x8xf32>
      stablehlo.return %4 : tensor<8x8xf32>
    }, {
      %3 = stablehlo.dot_general %arg2, %arg1, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<8x8xf32>
      %4 = stablehlo.transpose %3, dims = [1, 0] : (tensor<8x8xf32>) -> tensor<8x8xf32>
      stablehlo.return %4 : tensor<8x8xf32>
    }) : (tensor<i32>) -> tensor<8x8xf32>
    %2 = "stablehlo.case"(%0) ({
      %3 = stablehlo.dot_general %arg2, %arg3, contracting_dims = [1] x [1], precision = [DEFAULT, DEFAULT] : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
      %4 = stablehlo.negate %3 : tensor<4x8xf32>
      stablehlo.return %4 : tensor<4x8xf32>
    }, {
      %3 = stablehlo.dot_general %arg2, %arg3, contracting_dims = [1] x [1], precision = [DEFAULT, DEFAULT] : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
      stablehlo.return %3 : tensor<4x8xf32>
    }) : (tensor<i32>) -> tensor<4x8xf32>
    return %1, %2 : tensor<8x8xf32>, tensor<4x8xf32>
  }
}
